"""scripts/convert_checkpoint.py on a Qwen3 run (the tied flavor): dcp-to-hf writes what
transformers' Qwen3ForCausalLM loads with the run's logits, and hf-to-dcp (the family chosen by
config.json's model_type) gives back the run's weights bitwise."""

import pytest
import torch
from conftest import TINY_TRAIN, load_dcp_model
from script_runner import load_script

import train
from titanlite.build import model_args_for
from titanlite.config_parse import parse_args
from titanlite.data.tokenizer import build_tokenizer
from titanlite.models import get_family

transformers = pytest.importorskip("transformers")
conv = load_script("convert_checkpoint")

QWEN3 = get_family("qwen3")
RUN = [*TINY_TRAIN, "--model.name", "qwen3", "--model.flavor", "debugmodel_tied"]


def test_dcp_to_hf_and_back(tmp_path):
    run = [*RUN, "--training.steps", "1", "--checkpoint.enable"]
    assert train.main([*run, "--job.dump_folder", str(tmp_path / "run")]) == 0
    step_dir = tmp_path / "run" / "checkpoint" / "step-1"
    cfg = parse_args(RUN)
    args = model_args_for(cfg, build_tokenizer(cfg.model))
    ours = load_dcp_model(QWEN3.model_cls(args).eval(), step_dir)

    assert conv.main(["dcp-to-hf", str(step_dir), str(tmp_path / "hf")]) == 0
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf.eval()(tokens).logits, atol=1e-4, rtol=0)

    assert conv.main(["hf-to-dcp", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back = load_dcp_model(QWEN3.model_cls(args), tmp_path / "back")
    for name, w in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], w), name
