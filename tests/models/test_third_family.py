"""The family hook, proven: a third family, defined only in this file (its own args, model,
FSDP-only parallelize, init, FLOPs, HF key map), registers and trains a step under FSDP 2 in
real train.py processes, with no other file changed. Run as a script, this file is each rank's
worker: it registers the family, then runs train.main."""

import math
import sys
from dataclasses import dataclass, replace
from typing import ClassVar

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from titanlite.config import ConfigError
from titanlite.hf import HFFormat
from titanlite.loss import cross_entropy_sum, linear_cross_entropy_sum
from titanlite.models import FAMILIES, ModelFamily, register


@dataclass
class MlpArgs:
    """A token-wise MLP language model: no attention at all."""

    family_name: ClassVar[str] = "mlp_lm"
    tie_embeddings: ClassVar[bool] = False
    dim: int
    n_layers: int
    vocab_size: int = 0
    max_seq_len: int = 0
    # What the trainer's checks read of any family's args.
    n_heads: int = 1
    n_kv_heads: int = 1
    head_dim: int = 1
    document_masking: bool = False
    attention_backend: str = "sdpa"

    @property
    def ffn_hidden_dim(self) -> int:
        return 4 * self.dim

    @property
    def num_kv_heads(self) -> int:
        return self.n_kv_heads


FLAVORS = {"tiny": MlpArgs(dim=32, n_layers=2)}


def mlp_args(flavor, vocab_size, max_seq_len, use_scaled_rope=False, **overrides):
    if flavor not in FLAVORS:
        raise ConfigError(f"unknown mlp_lm flavor {flavor!r}")
    overrides = {k: v for k, v in overrides.items() if k not in ("bos_id", "eos_id")}
    return replace(FLAVORS[flavor], vocab_size=vocab_size, max_seq_len=max_seq_len, **overrides)


class MlpLM(nn.Module):
    def __init__(self, args: MlpArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): nn.Linear(args.dim, args.dim) for i in range(args.n_layers)}
        )
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.chunked_loss, self.plain_loss = linear_cross_entropy_sum, cross_entropy_sum

    def num_params(self, exclude_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_embeddings.weight.numel() if exclude_embedding else n

    def forward(self, tokens, labels=None, chunk_tokens=0, positions=None, documents=None):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = h + torch.tanh(layer(h))
        if labels is None:
            return self.output(h)
        return self.plain_loss(self.output(h), labels)


def parallelize(model, parallel_dims, *, param_dtype, reduce_dtype, **_):
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if parallel_dims.fsdp_enabled:
        for layer in model.layers.values():
            fully_shard(layer, mesh=parallel_dims.fsdp_mesh, mp_policy=mp)
        fully_shard(model, mesh=parallel_dims.fsdp_mesh, mp_policy=mp)
    return model


def init_weights(model, seed, device):
    """Each rank draws the full tensors from `seed` and keeps its shard."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            full = torch.randn(p.shape, generator=gen) / math.sqrt(model.args.dim)
            if isinstance(p, DTensor):  # an FSDP shard
                full = distribute_tensor(full, p.device_mesh, p.placements).to_local()
                p.to_local().copy_(full)
            else:
                p.copy_(full)


def unsupported(*_, **__):
    raise ConfigError("mlp_lm trains under FSDP only")


MLP_LM = ModelFamily(
    name="mlp_lm",
    flavors=FLAVORS,
    model_args=mlp_args,
    model_cls=MlpLM,
    parallelize=parallelize,
    init_weights=init_weights,
    pipeline=unsupported,
    tensor_parallel=unsupported,
    flops_per_token=lambda params, args, seq_len: 6 * params,
    hf=HFFormat(
        model_type="mlp_lm",
        layer_keys={"weight": "dense.weight", "bias": "dense.bias"},
        global_keys={"tok_embeddings.weight": "embed.weight", "output.weight": "head.weight"},
        rope_keys={},
        config=lambda args, dtype: {"model_type": "mlp_lm", "hidden_size": args.dim},
    ),
    tp_split=(),
)

ARGV = [
    "--job.config_file", "debug_model.toml", "--model.name", "mlp_lm", "--model.flavor", "tiny",
    "--model.vocab_limit", "512", "--training.steps", "1", "--training.seq_len", "32",
    "--training.local_batch_size", "2", "--training.global_batch_size", "4",
    "--training.mixed_precision_param", "float32", "--parallelism.data_parallel_shard_degree",
    "2", "--metrics.peak_tflops", "1", "--metrics.log_freq", "1",
    "--no-metrics.enable_tensorboard",
]  # fmt: skip


@pytest.mark.slow
def test_a_family_defined_in_this_file_trains_a_step_under_fsdp2(tmp_path):
    from conftest import read_jsonl, torchrun_script

    torchrun_script(__file__, *ARGV, "--job.dump_folder", str(tmp_path), nproc=2)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1]
    assert math.isfinite(records[0]["loss"]) and records[0]["loss"] > 0


def test_the_family_is_refused_under_tp_by_its_own_record():
    with pytest.raises(ConfigError, match="FSDP only"):
        MLP_LM.tensor_parallel(None, None, False)
    assert "mlp_lm" not in FAMILIES  # registered only by the worker below


if __name__ == "__main__":
    register(MLP_LM)
    import train

    sys.exit(train.main())
