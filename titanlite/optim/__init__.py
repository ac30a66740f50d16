"""Optimizers (AdamW, Adam, Muon exact under every layout), parameter groups, the LR schedule
and the optimizer step inside backward."""

from titanlite.optim.build import (
    GroupedOptimizer,
    build_optimizer,
    resolve_implementation,
    state_bytes,
)
from titanlite.optim.groups import check_param_groups
from titanlite.optim.schedule import build_lr_scheduler, lr_factor
from titanlite.optim.step_in_backward import StepInBackward, maybe_step_in_backward

__all__ = [
    "GroupedOptimizer",
    "StepInBackward",
    "build_lr_scheduler",
    "build_optimizer",
    "check_param_groups",
    "lr_factor",
    "maybe_step_in_backward",
    "resolve_implementation",
    "state_bytes",
]
