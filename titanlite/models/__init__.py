"""model.name -> what a model family provides: one `ModelFamily` record per family, in a dict.

A family lives in its own folder and registers itself there; the one import line at the bottom
of this file loads it. The trainer, the dry run, the estimator, the HF converter and generate.py
ask `get_family(cfg.model.name)` and never import a family's modules directly
(tests/models/test_family_imports.py holds them to it). docs/model-families.md describes each
field, with Qwen3 as the worked example.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import nn

from titanlite.config import ConfigError
from titanlite.hf import HFFormat


@dataclass(frozen=True)
class ModelFamily:
    name: str  # model.name
    flavors: Mapping[str, object]  # flavor name -> its hyperparameters (the family's args class)
    # (flavor, vocab_size, max_seq_len, use_scaled_rope, **overrides) -> the args for a run.
    model_args: Callable[..., object]
    model_cls: Callable[[object], nn.Module]  # built on the meta device from the args
    # parallelize(model, parallel_dims, *, parallelism_cfg, param_dtype, reduce_dtype, ac_cfg,
    # compile_cfg, cpu_offload): in place, before the shards are allocated.
    parallelize: Callable[..., nn.Module]
    init_weights: Callable[[nn.Module, int, object], None]  # (model, seed, device): own shards
    # (model, plan, parallel_dims, prepare_stage, device) -> this rank's pipelined stages, each
    # passed through prepare_stage (parallelize + allocate); the trainer runs their
    # forward_backward per microbatch, then reduce_tied_grads once a step.
    pipeline: Callable[..., nn.Module]
    tensor_parallel: Callable[..., None]  # (model, tp_mesh, shard_logits): TP alone (inference)
    flops_per_token: Callable[[int, object, int], int]  # (params w/o embedding, args, seq_len)
    hf: HFFormat  # the Hugging Face key map and config.json (import and export)
    # Memory estimator: the parameter-name suffixes tensor parallelism splits, and the elements
    # per token one block saves for backward (no AC) beyond the shared decoder block's (the
    # estimator's block_activation_elems), before TP's split: (args) -> elements.
    tp_split: tuple[str, ...]
    extra_saved_per_token: Callable[[object], float] = lambda args: 0.0


FAMILIES: dict[str, ModelFamily] = {}


def pad_vocab(n: int, multiple: int = 128) -> int:
    """Round the tokenizer size up so the embedding/output shapes shard and tile evenly."""
    if n < 1 or multiple < 1:
        raise ValueError(
            f"pad_vocab needs n >= 1 and multiple >= 1, got n={n}, multiple={multiple}"
        )
    return multiple * ((n + multiple - 1) // multiple)


def register(family: ModelFamily) -> ModelFamily:
    FAMILIES[family.name] = family
    return family


def family_of_hf(model_type: str) -> ModelFamily:
    """The family whose Hugging Face config.json says `model_type`."""
    for family in FAMILIES.values():
        if family.hf.model_type == model_type:
            return family
    known = ", ".join(f.hf.model_type for f in FAMILIES.values())
    raise ConfigError(f"no registered model family reads HF model_type {model_type!r}: {known}")


def get_family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ConfigError(f"model.name {name!r} is not a registered model; registered: "
                          f"{', '.join(FAMILIES)}")  # fmt: skip
    return FAMILIES[name]


# The families: each registers itself on import.
import titanlite.models.llama  # noqa: E402, F401, I001
import titanlite.models.qwen3  # noqa: E402, F401, I001
