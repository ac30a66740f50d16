"""What a training run asks of the planner: the layout under --parallelism.plan auto, and the
prediction it logs beside its measurements (which --calibrate later reads back)."""

import logging

import torch

from titanlite.config import ConfigError, JobConfig
from titanlite.config_parse import with_options
from titanlite.float8 import float8_enabled
from titanlite.host import memory_per_local_rank
from titanlite.job import Job
from titanlite.memory_estimate import GIB, MemoryEstimate, estimate
from titanlite.plan import calibrate
from titanlite.plan.devices import DEVICES, device_named, get_device
from titanlite.plan.perf import predict
from titanlite.plan.search import Choices, Cluster, flags, search
from titanlite.plan.shape import layout_of, model_of, setup_from_config, vocab_size_of

logger = logging.getLogger("titanlite")


def gpu_kind(config: JobConfig, device: torch.device) -> str | None:
    """The device-table entry to plan and predict for: parallelism.plan_device, else this GPU's."""
    if config.parallelism.plan_device:
        return config.parallelism.plan_device
    return device_named(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def plan_layout(config: JobConfig, world_size: int, device: torch.device) -> JobConfig:
    """--parallelism.plan auto: a copy of `config` with the fastest layout that fits this
    world (the run's saved config.toml then holds it), before anything is built; `config` is left as
    it is. Every rank plans alike from the same inputs."""
    kind = gpu_kind(config, device)
    if kind is None:
        raise ConfigError(f"parallelism.plan auto plans for a GPU of the device table ("
                          f"{', '.join(DEVICES)}), but this is {device}: set "
                          f"--parallelism.plan_device, or --parallelism.plan off")  # fmt: skip
    if config.training.global_batch_size == -1:
        raise ConfigError("parallelism.plan auto keeps the global batch whatever the world size "
                          "(the same data order on any number of GPUs): set "
                          "--training.global_batch_size")  # fmt: skip
    gpus_per_node = min(world_size, torch.cuda.device_count() or world_size)
    cluster = Cluster(world_size, gpus_per_node, get_device(kind))
    model = model_of(config, vocab_size_of(config)[0])
    choices = Choices(float8=(float8_enabled(config),), compile=config.compile.enable)
    plan = search(model, cluster, config.training.global_batch_size, calibrate.load(kind), choices)
    if not plan.fits:
        batch = config.training.global_batch_size
        raise ConfigError(f"parallelism.plan auto: no layout of {config.model.flavor} with global "
                          f"batch {batch} fits {world_size} x {kind}")  # fmt: skip
    best = plan.fits[0]
    logger.info("plan auto: %s, local batch %d x %d microbatches, AC %s, loss chunk %s on %d x "
                "%s: predicted %.0f tokens/s per GPU, %.1f GiB", best.layout.describe(),
                best.layout.local_batch_size, best.layout.accumulation, best.layout.ac,
                best.layout.chunk_tokens or "off", world_size, kind,
                best.prediction.tokens_per_s_per_gpu, best.memory_gib)  # fmt: skip
    return with_options(config, flags(best.layout))


def prediction(job: Job, device: torch.device) -> dict:
    """What the planner predicts for this run, as metrics of its first logged step: peak memory
    (the estimator, on this device type) and, on a GPU of the device table, the step time."""
    config, model_args = job.config, job.model_args
    world_size = job.parallel_dims.world_size
    setup = setup_from_config(config, world_size, model_args, device.type)
    peak = estimate(setup)
    memory = peak.total / GIB
    out = {"world_size": world_size, "vocab_size": model_args.vocab_size,
           "predicted_memory_gib": memory, "predicted_step_s": None}  # fmt: skip
    kind, step = gpu_kind(config, device), ""
    if kind is not None:  # an unknown plan_device is one ConfigError here
        model = model_of(config, model_args.vocab_size)
        gpus_per_node = min(world_size, torch.cuda.device_count() or world_size)
        lo = layout_of(job)
        p = predict(model.shape, lo, get_device(kind), gpus_per_node, calibrate.load(kind))
        out["predicted_step_s"] = p.step_s
        step = f", step {p.step_s:.3f} s on {kind}"
    logger.info("predicted: peak %.2f GiB per rank%s", memory, step)
    warn_if_it_will_not_fit(peak, device)
    return out


def warn_if_it_will_not_fit(peak: MemoryEstimate, device: torch.device) -> None:
    """A warning, before anything is built, for a run whose estimated peak is more than this
    rank's memory: on a CPU the kernel kills such a run without a word of why, and on a GPU the
    out-of-memory error may come only after minutes of start-up and compile. A warning, not an
    error: the estimate is not exact, and swap or a spare margin may still carry the run."""
    if device.type == "cuda":
        capacity, what = torch.cuda.get_device_properties(device).total_memory, "this GPU's"
    elif device.type == "cpu":
        capacity, what = memory_per_local_rank(), "the host memory available to this rank,"
    else:
        return
    if capacity is None or peak.total <= capacity:
        return
    largest = sorted(peak.rows.items(), key=lambda row: -row[1])[:2]
    parts = ", ".join(f"{name} {size / GIB:.1f} GiB" for name, size in largest)
    logger.warning(
        f"predicted peak {peak.total / GIB:.1f} GiB per rank (largest: {parts}) is more than "
        f"{what} {capacity / GIB:.1f} GiB: the run will likely run out of memory. To fit: lower "
        "--training.local_batch_size (a set --training.global_batch_size is kept by accumulating "
        "microbatches) or --training.seq_len, set --loss.chunk_tokens 2048 (the logits) or "
        "--activation_checkpoint.mode full (the activations), or shard over more ranks "
        "(scripts/estimate_memory.py shows what each option saves)"
    )
