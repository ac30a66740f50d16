"""Qwen3 (dense), registered as model.name "qwen3": the shared decoder
(titanlite/models/decoder/) with QK-norm, Qwen3's args and flavors (some tie the output to the
embedding), its HF layout and the estimator's extra saved activations of QK-norm."""

from titanlite.models import register
from titanlite.models.decoder import decoder_family
from titanlite.models.qwen3.args import QWEN3_FLAVORS, get_model_args
from titanlite.models.qwen3.hf import QWEN3_HF


def qk_norm_saved_per_token(args) -> float:
    """Elements one block saves for QK-norm per token: each norm keeps its input (q's and k's
    heads) and an fp32 rstd per head (two compute-dtype elements at bf16; the estimator counts
    elements of the compute dtype, and this upper bound keeps fp32 runs safe)."""
    heads = args.n_heads + args.n_kv_heads
    return heads * args.head_dim + 2 * heads


QWEN3 = register(
    decoder_family(
        "qwen3",
        QWEN3_FLAVORS,
        get_model_args,
        QWEN3_HF,
        extra_saved_per_token=qk_norm_saved_per_token,
    )
)
