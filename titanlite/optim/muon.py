"""Muon, exact under every layout: each matrix is orthogonalized whole.

torch.optim.Muon's update (momentum, Nesterov, Newton-Schulz in bf16, decoupled weight decay,
the shape's lr adjustment) is elementwise except Newton-Schulz, which needs the whole matrix:
orthogonalizing a shard (FSDP's rows, TP's rows or columns) is a different, wrong update. Here a
DTensor update is all-gathered over its mesh, the matrix's owner (matrices dealt round-robin
over the mesh's ranks, so each runs Newton-Schulz on its share) orthogonalizes it, broadcasts
the bf16 result, and each rank keeps its own shard of it. Momentum stays sharded, as the
parameter. One process (plain tensors, or a one-rank mesh) runs torch's own code, unchanged.

Per matrix of N elements on a mesh of W ranks, a rank receives (W - 1) / W x 4N bytes (the fp32
all-gather) and, unless it owns the matrix, 2N (the bf16 broadcast): docs/optimizers.md.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from titanlite.optim.closure import closure_loss
from titanlite.torch_compat import muon_adjusted_lr, muon_newton_schulz


class Muon(torch.optim.Muon):
    """torch.optim.Muon whose Newton-Schulz sees each DTensor matrix whole (module docstring)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        owners = {}  # mesh -> matrices dealt so far, so each rank takes every W-th
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group, owners)
        return loss

    def _update(self, p, group, owners: dict) -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        buf, grad, momentum = state["momentum_buffer"], p.grad, group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if group["nesterov"] else buf
        ns = (group["ns_coefficients"], group["ns_steps"], group["eps"])
        if isinstance(update, DTensor):
            update = _orthogonalize_whole(update, ns, owners)
        else:
            update = muon_newton_schulz(update, *ns)
        lr = group["lr"]
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(update, alpha=-muon_adjusted_lr(lr, group["adjust_lr_fn"], p.shape))


def _orthogonalize_whole(update: DTensor, ns: tuple, owners: dict) -> DTensor:
    """Newton-Schulz of the whole matrix, run by its owner, as a DTensor laid out as `update`."""
    mesh, placements = update.device_mesh, update.placements
    full = update.full_tensor()  # the all-gather over every sharded mesh dim
    if mesh.size() == 1:
        out = muon_newton_schulz(full, *ns)
    else:
        dealt = owners.get(mesh, 0)
        owners[mesh] = dealt + 1
        owner = _coordinate(dealt % mesh.size(), mesh.shape)
        mine = list(mesh.get_coordinate()) == owner
        # Contiguous: a tall matrix's result is a transposed view, which would be sent in its
        # storage order.
        out = muon_newton_schulz(full, *ns).contiguous() if mine else None
        out = _broadcast(out, full.shape, owner, mesh)
    # Each rank cuts its own shard from the whole result: no communication.
    return distribute_tensor(out, mesh, placements, src_data_rank=None)


def _coordinate(index: int, shape: tuple[int, ...]) -> list[int]:
    coord = []
    for size in reversed(shape):
        coord.append(index % size)
        index //= size
    return coord[::-1]


def _broadcast(out, shape, owner: list[int], mesh) -> torch.Tensor:
    """The owner's result to every rank of the mesh: along each mesh dim in turn, from the rank
    at the owner's coordinate (after dim d, every rank whose coordinates past d match the owner's
    holds it)."""
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16, device=mesh.device_type)
    for dim, src in enumerate(owner):
        group = mesh.get_group(dim)
        dist.broadcast(out, src=dist.get_global_rank(group, src), group=group)
    return out
