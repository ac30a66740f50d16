"""Process-group setup, cross-mesh gradient norms and clipping, small reduction helpers, and a
tensor's way to this rank's device or its local shard.

Works the same under torchrun (any world size) and plain `python` (a one-rank process group):
every helper degrades to a no-op when there is nothing to reduce over.
"""

import contextlib
import gc
import os
from collections.abc import Iterable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from titanlite.host import cpus_per_local_rank, keep_freed_memory
from titanlite.torch_compat import (
    fake_store,
    foreach_norm,
    process_groups,
    release_mesh_groups,
    set_group_timeout,
)


def init_distributed(
    cpu_backend: bool = False, timeout_s: float = 300
) -> tuple[int, int, int, torch.device]:
    """Start the process group, its collectives timing out after `timeout_s`; return (rank,
    local_rank, world, device).

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
    else:
        keep_freed_memory()
        if "OMP_NUM_THREADS" not in os.environ:
            # N ranks on one host each defaulting to all cores oversubscribe the CPU badly; an
            # explicit OMP_NUM_THREADS (torchrun sets 1 when it starts >1 process) is the user's
            # choice and wins.
            torch.set_num_threads(cpus_per_local_rank())

    if not dist.is_initialized():
        # A device_id makes NCCL form the communicator now, and the mesh's groups split from it
        # (ncclCommSplit) instead of each bootstrapping its own at first use: a faster start at
        # scale, and a bad NCCL setup fails here. gloo takes none.
        device_id = device if device.type == "cuda" else None
        timeout = timedelta(seconds=timeout_s)
        if launched:
            _init_process_group(backend, device_id, timeout)
        else:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id,
                timeout=timeout,
            )  # fmt: skip
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


def init_fake_distributed(
    rank: int, world_size: int, device: torch.device | None = None
) -> tuple[int, int, int, torch.device]:
    """One process plays `rank` of `world_size` over torch's fake process group: collectives
    return at once without moving data, so meshes, DTensor and FSDP build exactly as on the
    real job while only this rank's shards exist, on `device` (the dry run's CPU, or the
    rehearsal's GPU)."""
    device = device or torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    return rank, 0, world_size, device


def _init_process_group(backend: str, device_id: torch.device | None, timeout) -> None:
    """init_process_group on torchrun's store, namespaced by the elastic restart count where
    that store outlives the group."""
    store, rank, world_size = next(dist.rendezvous("env://"))
    store = dist.PrefixStore(store_namespace(os.environ), store)
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world_size, device_id=device_id,
        timeout=timeout,
    )  # fmt: skip


def store_namespace(environ) -> str:
    """The key prefix of this group's rendezvous in torchrun's store.

    By default torchrun's agent of node rank 0 hosts one store for all its groups: after
    `--max-restarts` restarts a group, it still holds the previous attempt's keys (gloo's peer
    addresses among them), and a restarted rank that reads one before its peer overwrites it
    connects to a dead address ("Connection refused"); a per-attempt prefix gives each attempt a
    clean namespace. Every agent counts the same restarts only while the membership stays: a
    node that joins an elastic range (`--nnodes MIN:MAX`) starts at 0 while the others count on,
    and a membership change restarts the group without counting. So an elastic range runs with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, where rank 0 hosts a fresh store for each group, whose
    ranks must then share the plain namespace.
    """
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return "titanlite/"
    return f"titanlite/attempt_{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def set_collective_timeout(seconds: float, keep=()) -> None:
    """Every process group's collective timeout but those of the groups in `keep`. The ranks
    meet first, so none runs a collective under the new timeout while another still works under
    the old one."""
    dist.barrier()
    for group in process_groups():
        if group not in keep:
            set_group_timeout(group, seconds)


class CollectiveTimeouts:
    """comm.init_timeout_seconds until the first step is done and during checkpoint saves
    (they wait on the slowest rank's writes), comm.train_timeout_seconds otherwise: a rank that
    died or hangs then stops the others within that time. The groups in `keep` (an async save's
    own, whose collectives run while training goes on) keep the timeout they were made with."""

    def __init__(self, comm, keep=()):
        self.init_s, self.train_s, self.keep = (
            comm.init_timeout_seconds, comm.train_timeout_seconds, keep,
        )  # fmt: skip

    def training(self) -> None:
        set_collective_timeout(self.train_s, self.keep)

    @contextlib.contextmanager
    def saving(self, step: int):
        """The save of `step`; a peer lost during it (seconds of writes between collectives) is
        the same one line as in a step, naming the timeout in force."""
        set_collective_timeout(self.init_s, self.keep)
        with peers_watched(step, self.init_s, "comm.init_timeout_seconds while saving"):
            yield
        self.training()


class PeerFailure(RuntimeError):
    """A collective failed because another rank died or hangs."""


# What gloo says when a peer is gone (its connection closed) or silent past the timeout; NCCL
# aborts the process from its watchdog instead, within the same timeout.
_PEER_LOST = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer")


@contextlib.contextmanager
def peers_watched(step: int, timeout_s: float, option: str = "comm.train_timeout_seconds"):
    """Re-raise a collective's failure inside step `step` (or its save) as PeerFailure: one line
    naming the step, the timeout and its `option`, and what the backend said, instead of a
    traceback per rank."""
    try:
        yield
    except PeerFailure:
        raise
    except RuntimeError as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        if not any(sign in str(e) for sign in _PEER_LOST):
            raise
        raise PeerFailure(
            f"step {step}: a collective failed, a rank died or hangs (the timeout is "
            f"{timeout_s:g} s, {option}): {reason}"
        ) from e


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
        # Each rank entered the barrier after its last collective on any group (an async save's
        # included: CheckpointManager.close waits for it), so no peer still needs any group.
        if barrier:
            release_mesh_groups()
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


def _reduce_group(grad: torch.Tensor) -> tuple:
    """Where a gradient's local sum of squares must be summed: the process groups of the mesh
    dims that do not replicate it (each rank there holds other elements); the replicated dims
    hold copies, which must not be counted twice. () for a plain tensor: a full copy here."""
    if not isinstance(grad, DTensor):
        return ()
    mesh = grad.device_mesh
    return tuple(mesh.get_group(i) for i, pl in enumerate(grad.placements) if not pl.is_replicate())


def _summed(grad: torch.Tensor) -> torch.Tensor:
    """A gradient with pending sums (partial on a mesh dim: the norm weights' under sequence
    parallelism) with them done: a norm is not the sum of its parts' norms."""
    if not isinstance(grad, DTensor) or not any(pl.is_partial() for pl in grad.placements):
        return grad
    return grad.redistribute(
        placements=[Replicate() if pl.is_partial() else pl for pl in grad.placements]
    )


@torch.no_grad()
def grad_square_sums(
    groups: Sequence[Iterable[torch.nn.Parameter]], pp_mesh: DeviceMesh | None = None
) -> torch.Tensor:
    """Each parameter group's sum of squared gradient elements over all its shards, as a vector
    on every rank; the global grad norm is the square root of its total.

    Under any layout: the local shards' norms are taken in one foreach call per set of mesh dims
    that shard them (per-parameter DTensor norms cost ~70 us of host time each, 10 ms a step at
    1B, which an eager GPU step waits for), summed over those dims with one all-reduce per set,
    then over the pipeline stages of `pp_mesh` (each rank holds only its stages' parameters: a
    group with none on this rank adds 0 here). Accumulated in fp64 on CPU: fp32 CPU norm kernels
    drift by ~1e-4 relative on a 25M element grad (the debug model's output layer), by a
    different amount for each shard layout.
    """
    buckets: dict[tuple, dict[int, list[torch.Tensor]]] = {}
    for i, params in enumerate(groups):
        for p in params:
            # (A tied weight's copy on the last pipeline stage: the first stage counts it.)
            if p.grad is not None and not getattr(p, "counted_on_another_stage", False):
                grad = _summed(p.grad)
                key = (_reduce_group(grad), grad.device)
                buckets.setdefault(key, {}).setdefault(i, []).append(local_value(grad))
    sums = None
    for (reduce_over, device), by_group in buckets.items():
        acc = torch.float64 if device.type == "cpu" else torch.float32
        part = torch.zeros(len(groups), dtype=acc, device=device)
        for i, grads in by_group.items():
            part[i] = torch.stack(foreach_norm(grads, acc)).square().sum()
        for group in reduce_over:
            part = dist_sum(part, group)
        sums = part if sums is None else sums + part
    if sums is None:  # no gradients at all on this rank
        sums = torch.zeros(len(groups), dtype=torch.float64)
    return dist_sum(sums, pp_mesh) if pp_mesh is not None else sums


def block_names(n_layers: int) -> list[str]:
    """The blocks whose grad norms metrics.log_layer_grad_norms logs: the embedding, each
    transformer block, and the output head (the final norm and the output projection)."""
    return ["tok_embeddings", *(f"layers.{i}" for i in range(n_layers)), "output"]


def params_by_block(model, names: list[str]) -> list[list[torch.nn.Parameter]]:
    """This rank's parameters of each block in `names` (none for blocks on other pipeline
    stages), by Meta's names; wrapper segments (_orig_mod, _checkpoint_wrapped_module) start
    with an underscore and are skipped."""
    groups = {name: [] for name in names}
    for name, p in model.named_parameters():
        parts = [s for s in name.split(".") if not s.startswith("_")]
        block = ".".join(parts[:2]) if parts[0] == "layers" else parts[0]
        groups[block if block in groups else "output"].append(p)
    return list(groups.values())


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[torch.nn.Parameter], max_norm: float, pp_mesh: DeviceMesh | None = None
) -> torch.Tensor:
    """Clip gradients by their global L2 norm over every mesh dim and pipeline stage; return the
    norm as a plain fp32 tensor (grad_square_sums of one group)."""
    params = list(params)
    return clip_by_total_(params, max_norm, grad_square_sums([params], pp_mesh).sum().sqrt())


@torch.no_grad()
def clip_by_total_(
    params: Iterable[torch.nn.Parameter], max_norm: float, total: torch.Tensor
) -> torch.Tensor:
    """Clip gradients so that their global norm `total` (from grad_square_sums) is at most
    max_norm; return `total` as fp32. max_norm <= 0 only measures.

    torch's clip_grads_with_norm_ runs foreach kernels that fail when DTensors live on different
    meshes (e.g. FSDP-only norms next to FSDP x TP weights), so it runs once per mesh. A
    non-finite norm leaves the grads untouched, without reading it on the host here: the caller
    reads the norm once per step and stops or skips the step.
    """
    total = total.float()
    if max_norm <= 0:
        return total
    by_mesh: dict[object, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    # A non-finite norm is replaced by 0, whose clip factor is clamped to 1: a select on the
    # device instead of a branch on the host.
    clip_by = torch.where(total.isfinite(), total, 0.0)
    for ps in by_mesh.values():
        # Takes PARAMS (it reads p.grad); passing grads would silently clip nothing.
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, clip_by)
    return total
