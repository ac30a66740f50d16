"""Process-group setup, cross-mesh gradient clipping, small reduction helpers, and a tensor's
way to this rank's device or its local shard.

Works the same under torchrun (any world size) and plain `python` (a one-rank process group):
every helper degrades to a no-op when there is nothing to reduce over.
"""

import gc
import math
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from titanlite.host import cpus_per_local_rank


def init_distributed(cpu_backend: bool = False) -> tuple[int, int, int, torch.device]:
    """Start the process group; return (rank, local_rank, world, device).

    cuda:{LOCAL_RANK} + nccl when CUDA is present (plus gloo for CPU tensors with `cpu_backend`:
    FSDP's CPU offload keeps gradients there, and the grad norm reduces them), else cpu + gloo.
    Plain `python` (no RANK / WORLD_SIZE in the environment) is a world of one rank with its own
    in-memory store: every world, one included, has a process group, so meshes and FSDP's mixed
    precision exist in every layout.
    """
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0)) if launched else 0
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if launched else 0
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if launched else 1

    device, backend = device_and_backend(local_rank, cpu_backend, torch.cuda.is_available())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:
        # N ranks on one host each defaulting to all cores oversubscribe the CPU badly; an explicit
        # OMP_NUM_THREADS (torchrun sets 1 when it starts >1 process) is the user's choice and wins.
        torch.set_num_threads(cpus_per_local_rank())

    if not dist.is_initialized():
        # A device_id makes NCCL form the communicator now, and the mesh's groups split from it
        # (ncclCommSplit) instead of each bootstrapping its own at first use: a faster start at
        # scale, and a bad NCCL setup fails here. gloo takes none.
        device_id = device if device.type == "cuda" else None
        if launched:
            _init_process_group(backend, device_id)
        else:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id
            )
    return rank, local_rank, world_size, device


def device_and_backend(local_rank: int, cpu_backend: bool, cuda: bool) -> tuple[torch.device, str]:
    """This rank's device and process-group backend, where CUDA is present or not."""
    if not cuda:
        return torch.device("cpu"), "gloo"
    return torch.device("cuda", local_rank), "cuda:nccl,cpu:gloo" if cpu_backend else "nccl"


def device_backend(group, device_type: str) -> str:
    """The backend `group` runs `device_type`'s tensors on. dist.get_backend names one ("nccl")
    or, for a group made with several (FSDP's CPU offload on CUDA), the list
    "cuda:nccl,cpu:gloo"."""
    backend = str(dist.get_backend(group))
    per_device = dict(part.split(":") for part in backend.split(",") if ":" in part)
    return per_device.get(device_type, backend)


def init_fake_distributed(rank: int, world_size: int) -> tuple[int, int, int, torch.device]:
    """One process plays `rank` of `world_size` over torch's fake process group: collectives
    return at once without moving data, so meshes, DTensor and FSDP build exactly as on the
    real job while only this rank's shards exist, on the CPU."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    return rank, 0, world_size, torch.device("cpu")


def _init_process_group(backend: str, device_id: torch.device | None) -> None:
    """init_process_group on torchrun's store, namespaced by the elastic restart count.

    After `torchrun --max-restarts` restarts a group, the agent's store still holds the previous
    attempt's keys (gloo's peer addresses among them); a restarted rank that reads one before
    its peer overwrites it connects to a dead address ("Connection refused"). A per-attempt
    prefix makes each attempt rendezvous in a clean namespace.
    """
    store, rank, world_size = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"titanlite/attempt_{attempt}/", store)
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world_size, device_id=device_id
    )


def destroy(barrier: bool = True) -> None:
    """Tear down the default process group if one exists (safe to call in world 1).

    barrier=False is for a rank leaving on an error of its own, whose peers may never reach a
    barrier; leaving the group to interpreter exit instead can abort the process ("terminate
    called without an active exception") and lose its exit code.
    """
    if dist.is_available() and dist.is_initialized():
        # No rank tears its connections down while a peer may still be talking to it: gloo
        # aborts a process whose peer vanished mid-exchange ("terminate called ...").
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
        # Groups still referenced from reference cycles (meshes held by a finished trainer's
        # modules) would otherwise be freed during interpreter shutdown, where gloo's worker
        # threads releasing their last work can abort the process ("terminate called ...").
        gc.collect()


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without blocking the host: from pinned memory, asynchronously."""
    if device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def local_value(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (the loss under loss parallel is a replicated one: its local
    value is the loss); a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _group(mesh_or_group):
    """The process group behind a 1-D mesh (or the group itself); None means 'nothing to reduce'."""
    if mesh_or_group is None or not (dist.is_available() and dist.is_initialized()):
        return None
    if isinstance(mesh_or_group, DeviceMesh):
        assert mesh_or_group.ndim == 1, "reduce over a flattened 1-D mesh"
        return mesh_or_group.get_group()
    return mesh_or_group


def _all_reduce(tensor: torch.Tensor, op, mesh_or_group) -> torch.Tensor:
    out = tensor.detach().clone()
    group = _group(mesh_or_group)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(out, op=op, group=group)
    return out


def dist_sum(tensor: torch.Tensor, mesh_or_group=None) -> torch.Tensor:
    """Sum of `tensor` over the ranks of a 1-D mesh / group (a copy; no-op in world 1)."""
    return _all_reduce(tensor, dist.ReduceOp.SUM, mesh_or_group)


def world_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of `tensor` over every rank of the job (a copy; no-op in world 1)."""
    return _all_reduce(tensor, dist.ReduceOp.SUM, dist.group.WORLD)


def _total_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """get_total_norm, accumulated in fp64 on CPU.

    CPU fp32 norm kernels drift by ~1e-4 relative on a 25M-element grad (debug model's output
    layer), by a different amount for each shard layout; fp64 makes the norm layout-invariant.
    GPU kernels reduce in a tree and stay in the grads' dtype. For DTensor grads each norm is a
    partial DTensor, reduced over the mesh by the caller's full_tensor().
    """
    acc = torch.float64 if grads[0].device.type == "cpu" else None
    norms = [torch.linalg.vector_norm(g, norm_type, dtype=acc) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[torch.nn.Parameter],
    max_norm: float,
    pp_mesh: DeviceMesh | None = None,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Clip gradients by their global norm over every mesh dim; return the norm as a plain tensor.

    torch's clip_grad_norm_ stacks per-param norms and fails when params live on different meshes
    (e.g. FSDP-only norms next to FSDP x TP weights), so the norm is taken per mesh group, made
    global with full_tensor(), and combined here, then over the pipeline stages of `pp_mesh`
    (each rank holds only its stages' parameters). max_norm <= 0 only measures. A non-finite norm
    leaves the grads untouched, without reading it on the host here: the caller reads the norm
    once per step and stops or skips the step.
    """
    groups: dict[object, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = []
    for ps in groups.values():
        n = _total_norm([p.grad for p in ps], norm_type)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else torch.zeros(())
    if pp_mesh is not None:  # every pipeline rank joins, in fp64: a sum of squares
        if math.isinf(norm_type):
            total = _all_reduce(total, dist.ReduceOp.MAX, pp_mesh)
        else:
            total = dist_sum(total.double() ** norm_type, pp_mesh) ** (1.0 / norm_type)
    total = total.float()
    if max_norm > 0:
        # A non-finite norm is replaced by 0, whose clip factor is clamped to 1: a select on the
        # device instead of a branch on the host.
        clip_by = torch.where(total.isfinite(), total, 0.0)
        for ps in groups.values():
            # Takes PARAMS (it reads p.grad); passing grads would silently clip nothing.
            torch.nn.utils.clip_grads_with_norm_(ps, max_norm, clip_by)
    return total
