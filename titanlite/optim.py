"""Optimizer and learning-rate schedule builders."""

import functools
import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def build_optimizer(model: torch.nn.Module, cfg) -> torch.optim.Optimizer:
    """AdamW over the model's parameters; norm weights (1-D) get no weight decay.

    Decaying a norm's gain pulls it toward zero for no regularization benefit, so the usual
    Llama recipe exempts it.
    """
    if cfg.name.lower() != "adamw":
        raise ValueError(f"optimizer.name {cfg.name!r} is not supported; use 'AdamW'")
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    impl = {
        "foreach": {"foreach": True},
        "fused": {"fused": True},
        "for-loop": {"foreach": False},
    }
    if cfg.implementation not in impl:
        raise ValueError(
            f"optimizer.implementation {cfg.implementation!r} is not one of {sorted(impl)}"
        )
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        **impl[cfg.implementation],
    )


def lr_factor(
    step: int, *, warmup: int, stable_end: int, total: int, decay_type: str, min_f: float
):
    """Multiplier of the peak LR at optimizer step `step` (0-based): warmup -> stable -> decay."""
    if step < warmup:
        # (step + 1) so the very first update already moves the weights.
        return (step + 1) / (warmup + 1)
    if step < stable_end:
        return 1.0
    progress = (step - stable_end) / max(1, total - stable_end)  # 0 -> 1 over the decay
    progress = min(progress, 1.0)
    if decay_type == "linear":
        decay = 1.0 - progress
    elif decay_type == "sqrt":
        decay = 1.0 - math.sqrt(progress)
    elif decay_type == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"lr_scheduler.decay_type {decay_type!r}: use linear, sqrt or cosine")
    return min_f + (1.0 - min_f) * decay


def build_lr_scheduler(optimizer, cfg, total_steps: int) -> LambdaLR:
    """Warmup for `warmup_steps`, hold, then decay over the last `decay_ratio` of the run
    (all of it after warmup when decay_ratio < 0) down to `min_lr_factor` x peak."""
    warmup = min(cfg.warmup_steps, total_steps)
    if cfg.decay_ratio < 0:
        stable_end = warmup
    else:
        if cfg.decay_ratio > 1:
            raise ValueError(
                f"lr_scheduler.decay_ratio must be in [0, 1] or -1, got {cfg.decay_ratio}"
            )
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
