"""Config -> this rank's model: the model args, the meta build, the pipeline cut, parallelize,
allocate on the device, initialize. No rank ever holds the whole model."""

from dataclasses import replace

import torch

from titanlite.float8 import maybe_convert_float8
from titanlite.models.llama.args import ModelArgs, get_model_args, pad_vocab
from titanlite.models.llama.model import Transformer
from titanlite.models.llama.parallelize import init_weights_parallel, parallelize_llama
from titanlite.models.llama.pipeline import PipelinedModel, cut_stages
from titanlite.precision import DTYPES


def model_args_for(cfg, tokenizer) -> ModelArgs:
    """The flavor's args for this run and its tokenizer (the vocab padded to shard evenly)."""
    return model_args_for_vocab(
        cfg, pad_vocab(tokenizer.n_words), tokenizer.bos_id, tokenizer.eos_id
    )


def model_args_for_vocab(cfg, vocab_size: int, bos_id: int = -1, eos_id: int = -1) -> ModelArgs:
    """The flavor's args with the run's vocab and sequence length, and the attention backend
    resolved for this machine (the estimator, which may have no tokenizer, starts here)."""
    args = get_model_args(
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
    with torch.device("meta"):
        model = Transformer(model_args)
    maybe_convert_float8(model, cfg)  # before TP and FSDP, which handle float8 linears
    if pipeline is None:
        return parallelize_and_allocate(model, cfg, parallel_dims, compute_dtype, device)
    pd = parallel_dims
    ids, stages = cut_stages(model, pipeline, pd.pp_mesh, pd.tp_mesh)
    stages = [parallelize_and_allocate(s, cfg, pd, compute_dtype, device) for s in stages]
    return PipelinedModel(stages, ids, pipeline, pd.pp_mesh, device)


def parallelize_and_allocate(model, cfg, parallel_dims, compute_dtype, device):
    parallelize_llama(
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


def count_params(model_args: ModelArgs, exclude_embedding: bool) -> int:
    """The whole model's parameter count (a rank may hold only some pipeline stages)."""
    with torch.device("meta"):
        return Transformer(model_args).num_params(exclude_embedding)


def init_model(model, seed: int, device, draw_weights: bool) -> None:
    """Every layout gets the same weights for `seed`, each rank drawing only its shards; without
    `draw_weights` (a checkpoint will overwrite them) only the buffers are computed."""
    if draw_weights:
        init_weights_parallel(model, seed, device)
    else:
        model.init_buffers(device)
