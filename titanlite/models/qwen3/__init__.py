"""Qwen3 (dense), registered as model.name "qwen3".

Its block is Llama's with QK-norm: the shared decoder, its TP/SP plan, pipeline split, weight
init and FLOPs are the llama3 record's, asked for through the registry (no module of another
family is imported); the args, flavors, HF layout and the estimator's extra saved activations
are Qwen3's own.
"""

from dataclasses import replace

from titanlite.models import get_family, register
from titanlite.models.qwen3.args import QWEN3_FLAVORS, get_model_args
from titanlite.models.qwen3.hf import QWEN3_HF


def qk_norm_saved_per_token(args) -> float:
    """Elements one block saves for QK-norm per token: each norm keeps its input (q's and k's
    heads) and an fp32 rstd per head (two compute-dtype elements at bf16; the estimator counts
    elements of the compute dtype, and this upper bound keeps fp32 runs safe)."""
    heads = args.n_heads + args.n_kv_heads
    return heads * args.head_dim + 2 * heads


QWEN3 = register(
    replace(
        get_family("llama3"),
        name="qwen3",
        flavors=QWEN3_FLAVORS,
        model_args=get_model_args,
        hf=QWEN3_HF,
        extra_saved_per_token=qk_norm_saved_per_token,
    )
)
