"""Rehearsal: real training steps of one rank of the target job, over fake collectives, on the
device present (`--comm.mode fake_backend --comm.fake_steps N`).

The rank is the real job's rank `comm.fake_rank` of `comm.fake_world_size`: its sharded
parameters, gradients and optimizer state, its own data (its data-parallel rank's share), its
pipeline stages, and real kernels. Collectives move no data, so everything but communication is
measured: peak memory and compute time per step, written to {dump_folder}/dry_run.json beside
the estimator's peak.

Values are meaningless (a fake reduce-scatter sums nothing; on some torch releases fake
collectives and receives leave their outputs as uninitialized memory), so no value may steer a
step: every step takes its optimizer update whatever its grad norm (train.py), an object
broadcast keeps this rank's own objects, and nothing that reads a value on the host (loss spikes,
validation, checkpoints) runs. A probe records what the fake collectives of this torch leave.
"""

import copy
import json
import logging
import os
import resource
import statistics
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from titanlite.distributed import destroy, init_fake_distributed, local_value
from titanlite.host import keep_freed_memory
from titanlite.job import World, resolve_job
from titanlite.memory_estimate import GIB, estimate
from titanlite.metrics import compute_throughput, default_expandable_segments
from titanlite.plan import calibrate
from titanlite.plan.devices import get_device
from titanlite.plan.perf import predict
from titanlite.plan.run import gpu_kind
from titanlite.plan.shape import layout_of, model_of, setup_from_config
from titanlite.straggler import synchronize
from titanlite.torch_compat import pipeline_stages_told

logger = logging.getLogger("titanlite")


def rehearse(cfg, trainer_cls) -> int:
    """Build train.py's Trainer (`trainer_cls`) as rank comm.fake_rank of comm.fake_world_size
    on this device, run comm.fake_steps steps, and write the rank's figures to dry_run.json."""
    cfg = rehearsal_config(cfg)
    comm = cfg.comm
    # The process as train.py sets up a real rank: its allocator, its malloc, its seed.
    default_expandable_segments(os.environ, torch.cuda.is_available())
    here = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dist_env = init_fake_distributed(comm.fake_rank, comm.fake_world_size, here)
    rank, _, world, device = dist_env
    torch.manual_seed(cfg.debug.seed)
    if device.type == "cpu":
        keep_freed_memory()
        torch.set_flush_denormal(True)  # garbage values must not slow the CPU's arithmetic
    probe = probe_fake_collectives(device)
    logger.warning(
        "rehearsal of rank %d of %d over fake collectives (%s): losses and grad norms are "
        "meaningless and never stop it; memory and step time are what it measures",
        rank, world, ", ".join(f"{k} {v}" for k, v in probe.items()),
    )  # fmt: skip
    with local_object_broadcasts():
        trainer = trainer_cls(cfg, dist_env)
        with stage_boundaries(trainer):
            seconds = timed_steps(trainer, comm.fake_steps, device)
    report = {
        "world_size": world,
        "rank": rank,
        "layout": str(trainer.parallel_dims),
        "device": device_name(device),
        "torch": torch.__version__,
        "params_local": sum(local_value(p).numel() for p in trainer.model.parameters()),
        "steps": len(seconds),
        "step_seconds": [round(s, 4) for s in seconds],
        **throughput(trainer, seconds, world),
        "measured_peak_gib": measured_peak_gib(device),
        "estimated_peak_gib": round(estimated_peak(cfg, trainer, world, rank, device), 3),
        "planner": planner_prediction(cfg, trainer, world, device),
        "fake_collectives": probe,
    }
    trainer.close()
    del trainer
    destroy()
    out = Path(cfg.job.dump_folder) / "dry_run.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    logger.info("rehearsal done:\n%s\nwritten to %s", json.dumps(report, indent=2), out)
    return 0


def rehearsal_config(cfg):
    """The job's config less what would read values on the host or write files a fake rank
    must not: checkpoints (saved or loaded), validation, downstream evaluation, loss-spike
    judging, TensorBoard/W&B."""
    cfg = copy.deepcopy(cfg)
    turned_off = {
        "checkpoint.enable": cfg.checkpoint.enable,
        "checkpoint.initial_load_path": bool(cfg.checkpoint.initial_load_path),
        "validation.enable": cfg.validation.enable,
        "training.loss_spike_factor": cfg.training.loss_spike_factor > 0,
        "metrics.enable_tensorboard": cfg.metrics.enable_tensorboard,
        "metrics.enable_wandb": cfg.metrics.enable_wandb,
        "eval.tasks": bool(cfg.eval.tasks),
    }
    cfg.checkpoint.enable, cfg.checkpoint.initial_load_path = False, ""
    cfg.validation.enable, cfg.training.loss_spike_factor = False, 0.0
    cfg.metrics.enable_tensorboard = cfg.metrics.enable_wandb = False
    cfg.eval.tasks = []
    if off := [name for name, on in turned_off.items() if on]:
        logger.info("rehearsal: off for its steps: %s", ", ".join(off))
    return cfg


@contextmanager
def local_object_broadcasts():
    """A fake broadcast of objects hands a non-source rank a garbage size (and a failed
    allocation of petabytes): in a world of one process, this rank's objects stand for the
    source's (every rank of the real job decides from the same files)."""
    with mock.patch.object(dist, "broadcast_object_list", lambda *args, **kwargs: None):
        yield


@contextmanager
def stage_boundaries(trainer):
    """Under PP, a stage learns the shape of what it receives from its neighbour stages' ranks
    at the first step (a fake receive of that description is garbage): here it is told. What
    crosses a Llama stage boundary, both ways, is one plain tensor shaped like the residual
    stream's local part: [pipeline microbatch, sequence / (CP x TP), dim] in the compute dtype
    (a wrong guess fails the first step loudly, on a shape mismatch)."""
    pd, t = trainer.parallel_dims, trainer.cfg.training
    if not pd.pp_enabled:
        yield
        return
    rows = t.local_batch_size // trainer.model.microbatches
    shape = (rows, t.seq_len // (pd.cp * pd.tp), trainer.model_args.dim)
    hidden = torch.empty(shape, dtype=trainer.compute_dtype, device="meta")
    with pipeline_stages_told(hidden):
        yield


def probe_fake_collectives(device: torch.device) -> dict[str, str]:
    """What this torch's fake collectives leave in a NaN-filled output: 'copied' (the local
    chunk, recent torch) or 'untouched' (whatever the buffer held: uninitialized memory where
    it came from torch.empty). Values steer no step either way; the report records it."""
    n, rank = dist.get_world_size(), dist.get_rank()
    ones = torch.ones(n, device=device)
    outs = {name: torch.full((k,), float("nan"), device=device)
            for name, k in (("reduce_scatter", 1), ("all_gather", n), ("recv", 1))}  # fmt: skip
    with warnings.catch_warnings():  # the *_tensor names are deprecated on 2.13, alone on 2.11
        warnings.simplefilter("ignore", FutureWarning)
        dist.reduce_scatter_tensor(outs["reduce_scatter"], ones)
        dist.all_gather_into_tensor(outs["all_gather"], ones[:1])
    if n > 1:
        dist.recv(outs["recv"], src=(rank + 1) % n)
    else:
        del outs["recv"]
    return {k: "copied" if bool(v.isfinite().all()) else "untouched" for k, v in outs.items()}


def timed_steps(trainer, steps: int, device: torch.device) -> list[float]:
    """`steps` training steps, each timed to the end of its device work."""
    seconds = []
    for _ in range(steps):
        synchronize(device)
        t0 = time.perf_counter()
        trainer.train_step()
        synchronize(device)
        seconds.append(time.perf_counter() - t0)
        trainer.state.step += 1
    return seconds


def throughput(trainer, seconds: list[float], world: int) -> dict:
    """Compute-only tokens/s per device and MFU, from the median step after the first (which
    compiles, and makes the optimizer's state)."""
    median = statistics.median(seconds[1:] or seconds)
    tokens = trainer.global_batch_size * trainer.cfg.training.seq_len / world
    figures = compute_throughput(tokens, median, trainer.flops_per_token, trainer.peak_flops)
    mfu = figures["mfu"]
    return {
        "median_step_seconds": round(median, 4),
        "tokens_per_s_per_device": round(figures["wps"], 1),
        "mfu_pct": None if mfu is None else round(mfu, 2),
    }


def measured_peak_gib(device: torch.device) -> dict[str, float]:
    """The process's peak: allocated and reserved by the CUDA allocator, or the RSS on CPU."""
    if device.type == "cuda":
        return {
            "allocated": round(torch.cuda.max_memory_allocated(device) / GIB, 3),
            "reserved": round(torch.cuda.max_memory_reserved(device) / GIB, 3),
        }
    return {"rss": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 3)}


def estimated_peak(cfg, trainer, world: int, rank: int, device: torch.device) -> float:
    """The estimator's peak (GiB) for this rank on this device type."""
    setup = setup_from_config(cfg, world, trainer.model_args, device=device.type, rank=rank)
    return estimate(setup).total / GIB


def planner_prediction(cfg, trainer, world: int, device: torch.device) -> dict | None:
    """The planner's figures for the whole job, communication included, on this GPU's kind
    (or parallelism.plan_device) with 8 GPUs per node: what the rehearsal's compute-only step
    leaves out. None on a device the table lacks."""
    kind = gpu_kind(cfg, device)
    if kind is None:
        return None
    vocab = trainer.model_args.vocab_size
    model, layout = model_of(cfg, vocab), layout_of(resolve_job(cfg, World(world), vocab))
    p = predict(model.shape, layout, get_device(kind), min(world, 8), calibrate.load(kind))
    return {"device": kind, "step_s": round(p.step_s, 4), "mfu_pct": round(100 * p.mfu, 2),
            "tokens_per_s_per_gpu": round(p.tokens_per_s_per_gpu, 1)}  # fmt: skip


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
