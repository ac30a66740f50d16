"""The learning-rate schedule: warmup, stable, decay; one factor for every parameter group."""

import functools
import logging
import math

from torch.optim.lr_scheduler import LambdaLR

logger = logging.getLogger("titanlite")


# lr_scheduler.decay_type -> the fraction of the peak above min_lr left at decay progress 0..1.
_DECAY = {
    "linear": lambda progress: 1.0 - progress,
    "sqrt": lambda progress: 1.0 - math.sqrt(progress),
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
}


def lr_factor(
    step: int, *, warmup: int, stable_end: int, total: int, decay_type: str, min_f: float
):
    """Multiplier of the peak LR at optimizer step `step` (0-based): warmup -> stable -> decay."""
    if step < warmup:
        # (step + 1) so the very first update already moves the weights; the peak is reached
        # at the last warmup step (torchtitan's schedule, so its runs' LRs carry over).
        return (step + 1) / warmup
    if step < stable_end:
        return 1.0
    progress = (step - stable_end) / max(1, total - stable_end)  # 0 -> 1 over the decay
    progress = min(progress, 1.0)
    return min_f + (1.0 - min_f) * _DECAY[decay_type](progress)


def build_lr_scheduler(optimizer, cfg, total_steps: int) -> LambdaLR:
    """Warmup for `warmup_steps`, hold, then decay over the last `decay_ratio` of the run
    (all of it after warmup when decay_ratio < 0) down to `min_lr_factor` x peak."""
    warmup = min(cfg.warmup_steps, total_steps)
    if warmup < cfg.warmup_steps:  # a short test run of a long job's config, most often
        logger.warning(
            "lr_scheduler.warmup_steps (%d) exceeds training.steps (%d): warming up over all "
            "%d steps, so the learning rate peaks at the last",
            cfg.warmup_steps, total_steps, total_steps,
        )  # fmt: skip
    if cfg.decay_ratio < 0:
        stable_end = warmup
    else:
        stable_end = max(warmup, total_steps - round(cfg.decay_ratio * total_steps))
    fn = functools.partial(
        lr_factor,
        warmup=warmup,
        stable_end=stable_end,
        total=total_steps,
        decay_type=cfg.decay_type,
        min_f=cfg.min_lr_factor,
    )
    return LambdaLR(optimizer, fn)
