"""The optimizer step inside backward (optimizer.early_step_in_backward)."""

import logging
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanlite.distributed import world_sum

logger = logging.getLogger("titanlite")


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
