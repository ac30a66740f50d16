"""Qwen3 (dense), registered as model.name "qwen3": the shared decoder
(titanlite/models/decoder/) with QK-norm, Qwen3's args and flavors (some tie the output to the
embedding), its HF layout and the estimator's extra saved activations of QK-norm."""

from titanlite.metrics import num_flops_per_token
from titanlite.models import ModelFamily, register
from titanlite.models.decoder import pipeline_decoder
from titanlite.models.decoder.model import Transformer
from titanlite.models.decoder.parallelize import (
    TP_SPLIT,
    apply_tp,
    init_weights_parallel,
    parallelize_decoder,
)
from titanlite.models.qwen3.args import QWEN3_FLAVORS, get_model_args
from titanlite.models.qwen3.hf import QWEN3_HF


def qk_norm_saved_per_token(args) -> float:
    """Elements one block saves for QK-norm per token: each norm keeps its input (q's and k's
    heads) and an fp32 rstd per head (two compute-dtype elements at bf16; the estimator counts
    elements of the compute dtype, and this upper bound keeps fp32 runs safe)."""
    heads = args.n_heads + args.n_kv_heads
    return heads * args.head_dim + 2 * heads


QWEN3 = register(
    ModelFamily(
        name="qwen3",
        flavors=QWEN3_FLAVORS,
        model_args=get_model_args,
        model_cls=Transformer,
        parallelize=parallelize_decoder,
        init_weights=init_weights_parallel,
        pipeline=pipeline_decoder,
        tensor_parallel=apply_tp,
        flops_per_token=num_flops_per_token,
        hf=QWEN3_HF,
        tp_split=TP_SPLIT,
        extra_saved_per_token=qk_norm_saved_per_token,
    )
)
