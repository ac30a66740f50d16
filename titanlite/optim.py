"""Optimizer and learning-rate schedule builders, and the optimizer step inside backward."""

import functools
import logging
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from titanlite.distributed import world_sum

logger = logging.getLogger("titanlite")


def build_optimizer(model: torch.nn.Module, cfg) -> torch.optim.Optimizer:
    """AdamW over the model's parameters; norm weights (1-D) get no weight decay.

    Decaying a norm's gain pulls it toward zero for no regularization benefit, so the usual
    Llama recipe exempts it.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    impl = {  # the config's choices for optimizer.implementation
        "foreach": {"foreach": True},
        "fused": {"fused": True},
        "for-loop": {"foreach": False},
    }
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        **impl[resolve_implementation(cfg.implementation, params)],
    )


def resolve_implementation(choice: str, params: list[torch.Tensor]) -> str:
    """ "auto": fused where every parameter is on one device, CUDA or CPU (the whole update in
    one fused kernel; torchtitan's default): on a CPU the update alone is 2-4x faster than
    foreach (the debug model, 2 threads: 11 against 39 ms). Parameters split between devices
    (CPU offload of some) get foreach, which takes any mix."""
    if choice != "auto":
        return choice
    devices = {p.device.type for p in params}
    return "fused" if devices in ({"cuda"}, {"cpu"}) else "foreach"


class StepInBackward:
    """optimizer.early_step_in_backward: `optimizer` steps each parameter as soon as its gradient
    is final (under FSDP: right after its reduce-scatter), and the gradient is freed at once, so
    the gradients of the whole model never exist together.

    It is the run's one optimizer, the object the LR scheduler drives and checkpoints save,
    stepped one parameter at a time: the update, its state and the checkpoint are exactly those
    of the normal step without clipping. The step is over before the gradient norm is known, so
    the hooks also sum its square, for the log and the non-finite check.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.optimizer = optimizer
        # Group indices, not groups: load_state_dict replaces the group dicts.
        self._group = {p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        # As clip_grad_norm_: fp64 on CPU, where fp32 sums drift with the shard layout.
        acc = torch.float64 if device.type == "cpu" else torch.float32
        self._norm_sq = torch.zeros((), dtype=acc, device=device)
        for p in self._group:
            p.register_post_accumulate_grad_hook(self._step)

    @torch.no_grad()
    def _step(self, param: torch.Tensor) -> None:
        self._norm_sq += _share_of_square(
            torch.linalg.vector_norm(param.grad, dtype=self._norm_sq.dtype)
        )
        # step() updates every parameter of its groups that has a gradient: shown this one
        # alone, with its group's current hyperparameters, it updates just this one.
        groups = self.optimizer.param_groups
        self.optimizer.param_groups = [{**groups[self._group[param]], "params": [param]}]
        try:
            self.optimizer.step()
        finally:
            self.optimizer.param_groups = groups
        param.grad = None

    def grad_norm(self) -> torch.Tensor:
        """The step's global gradient norm (one all-reduce); the next step's sum starts at 0."""
        total = world_sum(self._norm_sq).sqrt().float()
        self._norm_sq.zero_()
        return total


def maybe_step_in_backward(
    optimizer: torch.optim.Optimizer, cfg, max_norm: float, device: torch.device
) -> StepInBackward | None:
    """The StepInBackward that steps `optimizer` when cfg.early_step_in_backward is set, else
    None. It steps before the global norm is known, so a training.max_norm set with it is not
    applied, and said so: torchtitan runs this combination too, unclipped."""
    if not cfg.early_step_in_backward:
        return None
    step_in_backward = StepInBackward(optimizer, device)
    if max_norm > 0:
        logger.warning(
            "training.max_norm %g is not applied: optimizer.early_step_in_backward steps "
            "each parameter before the global norm is known, so nothing is clipped (the "
            "norm is still measured and logged); set --training.max_norm 0 to silence this",
            max_norm,
        )
    return step_in_backward


def _share_of_square(norm: torch.Tensor) -> torch.Tensor:
    """This rank's share of a gradient norm's square: summed over all ranks, the square. A
    DTensor norm is partial over the mesh dims that shard the gradient (its local value is the
    local shard's norm); the other ranks hold copies of it."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not isinstance(norm, DTensor):
        return norm.square() / world
    mesh, placements = norm.device_mesh, norm.placements
    shards = math.prod(mesh.size(i) for i, pl in enumerate(placements) if pl.is_partial())
    return norm.to_local().square() / (world // shards)


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
