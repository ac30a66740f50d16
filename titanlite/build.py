"""Config -> this rank's model: the model args, the meta build, the pipeline cut, parallelize,
allocate on the device, initialize. No rank ever holds the whole model. What the model family
provides comes from the model hook (titanlite.models), asked by model.name."""

import logging
from dataclasses import replace
from functools import partial

import torch

from titanlite.float8 import maybe_convert_float8
from titanlite.models import get_family, pad_vocab
from titanlite.precision import DTYPES

logger = logging.getLogger("titanlite")


def model_args_for(cfg, tokenizer):
    """The flavor's args for this run and its tokenizer (the vocab padded to shard evenly)."""
    vocab_size = pad_vocab(tokenizer.n_words)
    return model_args_for_vocab(cfg, vocab_size, tokenizer.bos_id, tokenizer.eos_id)


def model_args_for_vocab(cfg, vocab_size: int, bos_id: int = -1, eos_id: int = -1):
    """The flavor's args with the run's vocab and sequence length, and the attention backend
    resolved for this machine (the estimator, which may have no tokenizer, starts here)."""
    args = get_family(cfg.model.name).model_args(
        cfg.model.flavor,
        vocab_size=vocab_size,
        max_seq_len=cfg.training.seq_len,
        use_scaled_rope=cfg.model.use_scaled_rope,
        bos_id=bos_id,
        eos_id=eos_id,
        document_masking=cfg.model.document_masking,
    )
    backend = cfg.model.attention_backend
    if backend == "auto":  # flex attention trains only on CUDA (no CPU backward in torch)
        backend = "flex" if args.document_masking and torch.cuda.is_available() else "sdpa"
    return replace(args, attention_backend=backend)


def build_model(cfg, model_args, parallel_dims, compute_dtype, device, pipeline=None):
    """Meta build -> (cut into this rank's pipeline stages) -> parallelize -> allocate this
    rank's shards on the device (not yet initialized): no rank ever holds the whole model."""
    family = get_family(cfg.model.name)
    if parallel_dims.cp_enabled and cfg.parallelism.context_parallel_rotate_method == "alltoall":
        # torchtitan's alltoall passes K/V around the CP ring in cp - 1 steps; the all-gather
        # moves the same bytes at once, and attention sees the same K/V: the same numbers.
        logger.info(
            "parallelism.context_parallel_rotate_method alltoall: K/V are all-gathered instead "
            "of passed around the ring (the same numbers; the memory estimate counts them)"
        )
    with torch.device("meta"):
        model = family.model_cls(model_args)
    maybe_convert_float8(model, cfg)  # before TP and FSDP, which handle float8 linears
    prepare = partial(
        parallelize_and_allocate, cfg=cfg, parallel_dims=parallel_dims,
        compute_dtype=compute_dtype, device=device,
    )  # fmt: skip
    if pipeline is None:
        return prepare(model)
    return family.pipeline(model, pipeline, parallel_dims, prepare, device)


def parallelize_and_allocate(model, cfg, parallel_dims, compute_dtype, device):
    get_family(cfg.model.name).parallelize(
        model,
        parallel_dims,
        param_dtype=compute_dtype,
        reduce_dtype=DTYPES[cfg.training.mixed_precision_reduce],
        parallelism_cfg=cfg.parallelism,
        ac_cfg=cfg.activation_checkpoint,
        compile_cfg=cfg.compile,
        cpu_offload=cfg.training.enable_cpu_offload,
    )
    # CPU offload keeps the shards in host memory; init_model draws them on the device.
    return model.to_empty(device="cpu" if cfg.training.enable_cpu_offload else device).train()


def count_params(cfg, model_args, exclude_embedding: bool) -> int:
    """The whole model's parameter count (a rank may hold only some pipeline stages)."""
    with torch.device("meta"):
        return get_family(cfg.model.name).model_cls(model_args).num_params(exclude_embedding)


def init_model(cfg, model, device, draw_weights: bool) -> None:
    """Every layout gets the same weights for debug.seed, each rank drawing only its shards;
    without `draw_weights` (a checkpoint will overwrite them) only the buffers are computed."""
    if draw_weights:
        get_family(cfg.model.name).init_weights(model, cfg.debug.seed, device)
    else:
        model.init_buffers(device)
