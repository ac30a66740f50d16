"""Every check across options, before anything is built: what a job can get wrong that needs no
data, weights or device (degrees against the world size, the model's shapes against TP, the batch
arithmetic), and the few that need the device."""

import os
from typing import NamedTuple

import torch

from titanlite.build import model_args_for
from titanlite.config import ConfigError, JobConfig, check_early_step_batch, resolve_global_batch
from titanlite.data.tokenizer import build_tokenizer
from titanlite.float8 import check_float8
from titanlite.models.llama.args import ModelArgs
from titanlite.models.llama.pipeline import PipelinePlan, canonical_schedule, plan_pipeline
from titanlite.parallel_dims import ParallelDims


class JobLayout(NamedTuple):
    parallel_dims: ParallelDims
    tokenizer: object
    model_args: ModelArgs
    global_batch_size: int
    num_microbatches: int
    pipeline: PipelinePlan | None


def check_job(cfg: JobConfig, world_size: int) -> JobLayout:
    """What a config can get wrong that needs no data, weights or device: degrees against the
    world size, the model's shapes against TP, the batch arithmetic."""
    p, t = cfg.parallelism, cfg.training
    pd = ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, world_size=world_size,
        pp=p.pipeline_parallel_degree,
    )  # fmt: skip
    tokenizer = build_tokenizer(cfg.model)
    args = model_args_for(cfg, tokenizer)
    pd.validate_model(args)
    global_batch_size, num_microbatches = resolve_global_batch(t, pd.dp_degree)
    check_early_step_batch(cfg.optimizer, t, pd.dp_degree)
    check_float8(cfg, pd)
    canonical_schedule(p.pipeline_parallel_schedule)  # a typo fails with PP off too
    pipeline = None
    if pd.pp_enabled:
        check_pipeline_options(cfg)
        pipeline = plan_pipeline(args.n_layers, pd.pp, t.local_batch_size, p)
    return JobLayout(pd, tokenizer, args, global_batch_size, num_microbatches, pipeline)


def check_pipeline_options(cfg: JobConfig) -> None:
    """Options whose mechanics the pipeline schedule takes over, refused with the fix."""
    t, val = cfg.training, cfg.validation
    refused = {
        "optimizer.early_step_in_backward": cfg.optimizer.early_step_in_backward,
        "training.enable_cpu_offload": t.enable_cpu_offload,
        "training.accumulation_sync last (each schedule step reduces its gradients)": (
            t.accumulation_sync == "last"
        ),
        "validation.local_batch_size other than training's (the schedule's microbatches)": (
            val.enable and val.local_batch_size not in (-1, t.local_batch_size)
        ),
    }
    for what, on in refused.items():
        if on:
            raise ConfigError(f"pipeline parallelism does not support {what}; turn it off")


def check_attention_device(model_args: ModelArgs, device: torch.device) -> None:
    if model_args.attention_backend == "flex" and device.type == "cpu":
        raise ConfigError(
            "model.attention_backend flex cannot train on CPU: torch has no CPU backward for "
            "flex attention; use sdpa (the same mask, dense) or auto"
        )


def check_single_process(cfg: JobConfig) -> None:
    """The dry run and the seed checkpoint are one process's work, whatever the target world."""
    what = "--comm.mode fake_backend" if cfg.comm.mode == "fake_backend" else (
        "--checkpoint.create_seed_checkpoint" if cfg.checkpoint.create_seed_checkpoint else None
    )  # fmt: skip
    if what and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        raise ConfigError(
            f"{what} runs in a single process: use plain `python train.py`, not torchrun "
            "(the dry run plays the world given by --comm.fake_world_size)"
        )
