"""Every private torch name titanlite uses, one function each.

A private name (a leading underscore, or a module under torch.testing._internal) can change or
vanish in any torch release without a deprecation. Each function below says what it uses, why
no public API serves, and the releases it was checked on; tests/test_torch_compat.py runs each
one, so a release that breaks a shim fails there with its name (run it under every supported
torch: `scripts/check_torch.sh 2.11.0 tests/test_torch_compat.py`). Checked: torch 2.11.0 and
2.13.0 unless a function says otherwise.

Modules that import torch.distributed.pipelining or DCP internals are imported inside the
function that needs them: the pipelining import loads torch._dynamo (~0.5 s on a 2-core CPU),
which the planner and the config checks, importing this module, do not need.
"""

import contextlib
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

# -- process groups and meshes -------------------------------------------------------------------


def fake_store() -> dist.Store:
    """torch.testing._internal.distributed.fake_pg.FakeStore: the store torch's "fake" backend
    pairs with. A real store (HashStore, TCPStore) makes init_process_group wait for the other
    ranks of the world, which a fake run plays alone; torch ships no public store that answers
    without them."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def process_groups() -> list[dist.ProcessGroup]:
    """Every live process group, the default one included: c10d._world.pg_map's keys. torch
    has no public list of the groups it made (torchtitan reads the same map)."""
    return list(c10d._world.pg_map)


def set_group_timeout(group: dist.ProcessGroup, seconds: float) -> None:
    """c10d._set_pg_timeout: a made group's collective timeout. Public API sets it only when a
    group is made; torchtitan changes it after the first step with this same call."""
    c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """DeviceMesh._flatten: one 1-D mesh over several dims of a mesh, registered with the root
    mesh under `name`, so FSDP, the loss and the norms reduce over it in one collective. The
    public way (init_device_mesh with another shape) makes a new group for every row, unused
    ones included."""
    return mesh._flatten(name)


# The root meshes titanlite made (parallel_dims.build_mesh registers them): teardown releases
# their groups. Weak: a mesh that nothing else holds goes with its groups anyway. A list, not a
# WeakSet: meshes of the same shape compare equal, and each one holds its own groups.
_meshes: list[weakref.ref] = []


def track_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Note a root mesh titanlite made, for release_mesh_groups; returns it."""
    _meshes.append(weakref.ref(mesh))
    return mesh


def release_mesh_groups() -> None:
    """Drop the process groups the tracked meshes hold: a root mesh keeps its dims' and its
    flattened meshes' groups in DeviceMesh._pg_registry (2.13; absent in 2.11, where the groups
    are c10d's only). DTensor's module-level caches keep every mesh a DTensor used alive, so
    without this its groups outlive destroy_process_group() and gc (measured: 5 gloo groups with
    15 threads per rank of a 4-rank FSDP run) and are closed during interpreter shutdown, at a
    different moment on each rank. torch has no public way to release a mesh's groups."""
    for ref in _meshes:
        registry = getattr(ref(), "_pg_registry", None)  # None too for a mesh already freed
        if registry:
            registry.clear()
    _meshes.clear()


def local_shape_and_offset(shape, mesh: DeviceMesh, placements) -> tuple[tuple, tuple]:
    """torch.distributed.tensor._utils.compute_local_shape_and_global_offset: where this rank's
    shard of a DTensor of global `shape` sits. DTensor exposes the local tensor but not its
    offset; uneven shards make it more than shape // degree."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(shape), tuple(offset)


def all_gather_autograd(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """torch.distributed._functional_collectives.all_gather_single_autograd (2.13; 2.11 names it
    all_gather_tensor_autograd, which 2.13 keeps as a deprecated alias): an all-gather whose
    backward reduce-scatters the gradient. torch.distributed.nn.functional.all_gather has a
    backward too but returns a list and all-reduces the whole gradient (world times the bytes)."""
    import torch.distributed._functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single_autograd", funcol.all_gather_tensor_autograd)
    return gather(x, gather_dim=dim, group=group)


# -- kernels and ops -----------------------------------------------------------------------------


def foreach_norm(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """torch._foreach_norm: the 2-norms of many tensors in one kernel launch (what
    clip_grad_norm_ calls). The public torch.linalg.vector_norm is one launch per tensor: ~70 us
    of host time each, milliseconds a step at 1B."""
    return list(torch._foreach_norm(tensors, 2, dtype=dtype))


def cpu_flash_attention_ops():
    """aten._scaled_dot_product_flash_attention_for_cpu and its _backward: the kernels
    F.scaled_dot_product_attention runs on a CPU. Called directly so the backward can run in
    fp32 on bf16 inputs (titanlite.models.kernels); autograd's path offers no dtype choice."""
    aten = torch.ops.aten
    return (
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_flash_attention_for_cpu_backward,
    )


def selective_ac_saved_ops() -> set:
    """The ops whose outputs selective activation checkpointing keeps: the matmuls (the float8
    one and its amax among them), every attention kernel SDPA dispatches to, and TP's
    reduce-scatter. The attention kernels, _scaled_mm and _c10d_functional are private aten
    names; a policy sees ops, so no public name can stand for them (torchtitan lists the same)."""
    aten = torch.ops.aten
    return {
        aten.mm.default,
        aten._scaled_mm.default,
        aten.max.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,  # what Hopper picks
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.higher_order.flex_attention,  # document masks on CUDA
        # Under TP, recomputing would repeat the reduce-scatter collective.
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
    }


def checkpoint_wrapper(module: torch.nn.Module, **kwargs) -> torch.nn.Module:
    """torch.distributed.algorithms._checkpoint.checkpoint_wrapper: activation checkpointing as
    a module wrapper, which FSDP and compile then wrap per block (torchtitan's AC). The public
    torch.utils.checkpoint.checkpoint is a function a forward must call itself."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper as wrap,
    )

    return wrap(module, **kwargs)


# -- CUDA memory history -------------------------------------------------------------------------


def record_cuda_memory_history(max_entries: int | None) -> None:
    """torch.cuda.memory._record_memory_history: start (an int) or stop (None) recording the
    allocator's history. Documented in torch's "Understanding CUDA Memory Usage" page, but
    underscored; there is no public name."""
    if max_entries is None:
        torch.cuda.memory._record_memory_history(enabled=None)
    else:
        torch.cuda.memory._record_memory_history(max_entries=max_entries)


def cuda_memory_snapshot() -> dict:
    """torch.cuda.memory._snapshot: the recorded history in the format pytorch.org/memory_viz
    reads (the same page documents it; no public name)."""
    return torch.cuda.memory._snapshot()


# -- checkpoints ---------------------------------------------------------------------------------


def state_dict_stager(pin_memory: bool):
    """torch.distributed.checkpoint._state_dict_stager.StateDictStager: copies a state dict to
    host memory into buffers it keeps. The public DefaultStager closes it after each stage on
    2.11, so a second async save fails (titanlite.checkpoint.staging)."""
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    return StateDictStager(pin_memory=pin_memory, share_memory=False)


def fsspec_checkpoint_io() -> tuple[type, type]:
    """torch.distributed.checkpoint._fsspec_filesystem's FsspecWriter and FsspecReader: DCP's
    FileSystemWriter and FileSystemReader over any fsspec file system (s3://, gs://), used for
    checkpoints in object storage. Public classes in a private module: torch.distributed.checkpoint
    does not re-export them on 2.13 (only its storage-choosing helper imports them)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    return FsspecWriter, FsspecReader


def consolidate_hf_safetensors(sharded: str, out: str, file_of: dict[str, int]) -> None:
    """torch.distributed.checkpoint._consolidate_hf_safetensors
    .consolidate_safetensors_files_on_every_rank: sharded safetensors into full ones, the work
    split over the ranks. The public HuggingFaceStorageWriter(enable_consolidation=True) runs it
    all on rank 0."""
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files_on_every_rank,
    )

    consolidate_safetensors_files_on_every_rank(sharded, out, file_of)


def file_view(f, offset: int, length: int):
    """torch.distributed.checkpoint.utils._create_file_view: a read-only window on a file,
    which torch.load reads a DCP item's archive from (FileSystemReader does the same)."""
    from torch.distributed.checkpoint.utils import _create_file_view

    return _create_file_view(f, offset, length)


def narrow_by_index(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """torch.distributed._shard._utils.narrow_tensor_by_index: the stored slice a DCP read item
    names (FileSystemReader's own call); one narrow per dim, public pieces, but this is the
    function DCP's reader uses, so both read the same bytes."""
    from torch.distributed._shard._utils import narrow_tensor_by_index

    return narrow_tensor_by_index(t, offsets, lengths)


def storage_file_offset(t: torch.Tensor) -> int:
    """UntypedStorage._checkpoint_offset: where a tensor loaded with map_location="meta" has its
    bytes in the torch.save file (set by torch.load for meta storages). torch.load publishes no
    byte offsets; reading them is what lets titanlite read or write bytes in place."""
    return t.untyped_storage()._checkpoint_offset


def fake_tensor_mode():
    """torch._subclasses.fake_tensor.FakeTensorMode: tensors with shapes and no storage, which
    torch.serialization.skip_data saves as a skeleton. The meta device is not enough: torch.save
    refuses meta tensors, and skip_data documents fake tensors as its input."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


# -- pipeline schedules --------------------------------------------------------------------------


def pipeline_action(cell: str):
    """torch.distributed.pipelining.schedules._Action.from_str: one action of a CSV schedule in
    torch's notation ("2F0"); None for an empty cell, RuntimeError for a bad one. The CSV
    schedule (pipeline_parallel_schedule_csv) exists only through these private pieces."""
    from torch.distributed.pipelining.schedules import _Action

    return _Action.from_str(cell)


def check_pipeline_actions(actions, pp: int, num_stages: int, microbatches: int, owner) -> None:
    """schedules._validate_schedule, then _add_send_recv (the lowering the runtime runs): raise
    AssertionError where the schedule cannot run, before any weight exists."""
    from torch.distributed.pipelining.schedules import _add_send_recv, _validate_schedule

    _validate_schedule(actions, pp, num_stages, microbatches)
    _add_send_recv(
        {rank: [a for a in acts if a is not None] for rank, acts in actions.items()},
        stage_to_rank=owner,
        num_stages=num_stages,
    )


def csv_schedule(stages, microbatches: int, loss_fn, csv: str):
    """schedules._PipelineScheduleRuntime with _load_csv: the runtime that runs a schedule read
    from a CSV file, adding the sends and receives itself (torchtitan's path for the same
    option). No public schedule class takes a file."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    schedule = _PipelineScheduleRuntime(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    schedule._load_csv(csv)
    return schedule


def pipeline_stage_base():
    """PipelineStage whose connection warm-up (the private _get_init_p2p_neighbors_ops, which
    the schedule calls before its first step) skips the stage's own rank: 2.11 warms up to the
    previous and next stage's rank, the same rank on a V schedule's turn, and gloo cannot send
    to itself (2.13 warms up without it). The stage has no public hook for its warm-up.
    On the last stage, 2.11's private _validate_fwd_outputs (each forward's outputs against the
    first forward's shapes; 2.13 has no such check) is skipped: that output is the loss, a
    scalar or, with a mixture's per-source sums, [1 + n], and it is sent to no stage."""
    from torch.distributed.pipelining import PipelineStage

    class SkipSelfWarmupStage(PipelineStage):
        def _get_init_p2p_neighbors_ops(self):
            ops = super()._get_init_p2p_neighbors_ops()
            return [op for op in ops if op.group_peer != self.group_rank]

        def _validate_fwd_outputs(self, outputs):
            if not self.is_last:
                super()._validate_fwd_outputs(outputs)

    return SkipSelfWarmupStage


@contextlib.contextmanager
def pipeline_stages_told(hidden: torch.Tensor):
    """Every PipelineStage takes `hidden` (a meta tensor) as what crosses its boundaries, both
    ways, instead of receiving that description from its neighbour stages' ranks at the first
    step: a rehearsal's fake receive of it is garbage. 2.13 exchanges a description object
    (PipelineStage._recv_meta, pipelining._utils' _StageForwardMeta / _StageBackwardMeta built
    from extract_tensor_metas); 2.11 sends example tensors, forward only, through
    dist.recv_object_list. No public API lets a stage be told its shapes at run time."""
    from unittest import mock

    from torch.distributed.pipelining import PipelineStage

    if hasattr(PipelineStage, "_recv_meta"):  # 2.13
        from torch.distributed.pipelining import _utils

        metas = _utils.extract_tensor_metas((hidden,))

        def told(stage, src_stage):
            forward = src_stage < stage.stage_index
            return (_utils._StageForwardMeta if forward else _utils._StageBackwardMeta)(metas)

        with mock.patch.object(PipelineStage, "_recv_meta", told):
            yield
    else:  # 2.11

        def told_objects(objects, *args, **kwargs):
            objects[0] = (hidden,)

        with mock.patch.object(dist, "recv_object_list", told_objects):
            yield


# -- optimizers ----------------------------------------------------------------------------------


def muon_newton_schulz(update: torch.Tensor, coefficients, steps: int, eps: float):
    """torch.optim._muon._zeropower_via_newtonschulz: the orthogonalization torch.optim.Muon
    runs, reused so that titanlite's distributed Muon equals torch's bitwise on the same matrix.
    Muon's step has no public per-matrix hook. The same code in 2.11 and 2.13."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz(update, coefficients, steps, eps)


def muon_adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim._muon._adjust_lr: the shape's learning-rate scaling of torch.optim.Muon's
    adjust_lr_fn options ("original", "match_rms_adamw"), for the same reason as above. The same
    code in 2.11 and 2.13."""
    from torch.optim._muon import _adjust_lr

    return _adjust_lr(lr, adjust_lr_fn, shape)


# -- data ----------------------------------------------------------------------------------------


def shutdown_loader_workers(batches) -> None:
    """_MultiProcessingDataLoaderIter._shutdown_workers: what the iterator's __del__ calls.
    Called explicitly because an error raised from a worker keeps the iterator (and its
    processes) alive in the traceback; DataLoader has no public close."""
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:  # a single-process iterator has no workers
        shutdown()
