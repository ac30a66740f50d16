"""scripts/generate.py on a Qwen3 run (the tied flavor): greedy decoding gives the tokens that
transformers' Qwen3ForCausalLM generates greedily from the same weights."""

import json

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
gen = load_script("generate")

QWEN3 = get_family("qwen3")
RUN = [*TINY_TRAIN, "--model.name", "qwen3", "--model.flavor", "debugmodel_tied"]
NEW = 8


def test_greedy_generation_matches_transformers(tmp_path, capsys):
    assert train.main([*RUN, "--job.dump_folder", str(tmp_path), "--training.steps", "2",
                       "--checkpoint.enable"]) == 0  # fmt: skip
    config, step_dir = tmp_path / "config.toml", tmp_path / "checkpoint" / "step-2"
    argv = ["--config", str(config), "--checkpoint", str(step_dir), "--prompt", "def main(",
            "--max_new_tokens", str(NEW), "--temperature", "0", "--out"]  # fmt: skip
    capsys.readouterr()  # the training run's output
    assert gen.main(argv) == 0
    out = json.loads(capsys.readouterr().out)["responses"][0]

    cfg = parse_args(["--job.config_file", str(config)])
    tokenizer = build_tokenizer(cfg.model)
    args = model_args_for(cfg, tokenizer)
    ours = load_dcp_model(QWEN3.model_cls(args), step_dir)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3.hf.config(args, "float32")))
    hf.load_state_dict(QWEN3.hf.to_hf(ours.state_dict(), args, torch.float32), strict=False)
    hf.eval()
    prompt = torch.tensor([out["input_ids"]])
    with torch.no_grad():
        theirs = hf.generate(
            prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
            # The padding rows of the vocabulary are no tokens (generate.py never picks them).
            suppress_tokens=list(range(tokenizer.n_words, args.vocab_size)),
        )[0, prompt.shape[1]:].tolist()  # fmt: skip
    assert len(out["output_ids"]) == NEW
    assert out["output_ids"] == theirs
