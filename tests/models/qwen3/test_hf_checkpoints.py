"""Continued pretraining from a Hugging Face Qwen3 folder (written by transformers' own
save_pretrained) through the trainer, no conversion step: FSDP 2 loads it (every rank reading
its shards, the QK-norm weights' RoPE order undone across a shard split), trains a step at
learning rate 0 and exports in HF; the export is the original, bitwise, and transformers loads
it with the same logits. Tied and untied flavors."""

import pytest
import torch
from conftest import read_jsonl, train_many
from safetensors.torch import load_file

from titanlite.build import model_args_for
from titanlite.config_parse import parse_args
from titanlite.data.tokenizer import build_tokenizer
from titanlite.hf import hf_files
from titanlite.models import get_family

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # runs train.py on 2 ranks

QWEN3 = get_family("qwen3")
VOCAB_LIMIT = 512


def hf_weights(folder) -> dict[str, torch.Tensor]:
    weights = {}
    for f in sorted(set(hf_files(folder).values())):
        weights.update(load_file(str(f)))
    return weights


def hf_folder(path, args):
    """A random transformers Qwen3 of these args' shape, saved by transformers, norms random."""
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(**QWEN3.hf.config(args, "float32"))
    ).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape))
    model.save_pretrained(path)
    return model.eval()


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_tied"])
def test_fsdp2_loads_an_hf_qwen3_and_exports_it_bitwise(tmp_path, flavor):
    argv = [
        "--job.config_file", "qwen3_debug.toml", "--model.flavor", flavor,
        "--model.vocab_limit", str(VOCAB_LIMIT), "--training.seq_len", "32",
        "--training.local_batch_size", "2", "--training.global_batch_size", "4",
        "--training.mixed_precision_param", "float32", "--training.steps", "1",
        "--optimizer.lr", "0", "--optimizer.weight_decay", "0",
        "--parallelism.data_parallel_shard_degree", "2",
        "--checkpoint.enable", "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_path", str(tmp_path / "hf"),
        "--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf",
        "--metrics.log_freq", "1", "--no-metrics.enable_tensorboard",
        "--job.dump_folder", str(tmp_path / "run"),
    ]  # fmt: skip
    cfg = parse_args(argv)
    args = model_args_for(cfg, build_tokenizer(cfg.model))  # the run's padded vocabulary
    original = hf_folder(tmp_path / "hf", args)
    train_many([argv], nproc=2)
    export = tmp_path / "run" / "checkpoint" / "step-1"
    want, got = hf_weights(tmp_path / "hf"), hf_weights(export)
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert torch.equal(got[name], w), name
    again = transformers.Qwen3ForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, original(tokens).logits)
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]["step"] == 1
