"""Write checkpoints one tensor at a time: peak memory is about two tensors, not the model.

`save_lazily` writes a DCP checkpoint, `torch_save_lazily` a torch.save file; both take a nested
state dict whose big leaves are `LazyTensor`s, made only when their bytes are written and freed
before the next one is made. Loading either result gives exactly what saving the materialized
state would have given.
"""

import contextlib
import math
import os
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem

from titanlite.progress import Progress
from titanlite.torch_compat import fake_tensor_mode, storage_file_offset


@dataclass(frozen=True)
class LazyTensor:
    """A tensor made on demand. `make` must be deterministic: it may be called more than once."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]


@contextlib.contextmanager
def single_process_quietly():
    """DCP warns on every call without a process group; one process is what these tools are."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a")
        yield


def materialize(lazy: LazyTensor) -> torch.Tensor:
    """`lazy.make()`, checked against the promised shape and dtype (which planned the file)."""
    t = lazy.make()
    if tuple(t.shape) != tuple(lazy.shape) or t.dtype != lazy.dtype:
        raise ValueError(
            f"LazyTensor promised {tuple(lazy.shape)} {lazy.dtype}, "
            f"make() gave {tuple(t.shape)} {t.dtype}"
        )
    return t.detach().cpu().contiguous()


def _replace_lazy(state, make_stand_in: Callable[[LazyTensor], object]):
    """`state` with every LazyTensor leaf replaced (dicts and lists are walked)."""
    if isinstance(state, LazyTensor):
        return make_stand_in(state)
    if isinstance(state, dict):
        return {k: _replace_lazy(v, make_stand_in) for k, v in state.items()}
    if isinstance(state, list):
        return [_replace_lazy(v, make_stand_in) for v in state]
    return state


class _LazySavePlanner(DefaultSavePlanner):
    """Plans on meta stand-ins and makes each real tensor when DCP asks for its bytes (DCP's
    `resolve_data` is the documented place for lazy allocation)."""

    def __init__(self, lazy_by_stand_in: dict[int, LazyTensor], progress: Progress):
        super().__init__()
        self._lazy_by_stand_in = lazy_by_stand_in  # keyed by id(): the stand-ins stay alive
        self._progress = progress

    def resolve_data(self, write_item: WriteItem):
        lazy = self._lazy_by_stand_in.get(id(self.lookup_object(write_item.index)))
        if lazy is None:
            return super().resolve_data(write_item)
        t = materialize(lazy)
        self._progress.add(t.numel() * t.element_size())
        return t


def _nbytes(leaves) -> int:
    return sum(math.prod(lz.shape) * lz.dtype.itemsize for lz in leaves)


def save_lazily(state: dict, checkpoint_dir: Path | str, label: str = "writing") -> None:
    """`dcp.save(state)` (single process, no process group) with LazyTensor leaves made one at
    a time. Peak memory: about two tensors (the one written and the one being made). On a
    terminal, progress lines start with `label`."""
    lazy_by_stand_in: dict[int, LazyTensor] = {}

    def stand_in(lazy: LazyTensor) -> torch.Tensor:
        t = torch.empty(lazy.shape, dtype=lazy.dtype, device="meta")
        lazy_by_stand_in[id(t)] = lazy
        return t

    skeleton = _replace_lazy(state, stand_in)
    # One file per item: FileSystemWriter keeps every tensor of a file alive until the file is
    # done (its safetensors path needs them all), and a CUDA host stages a file's tensors ahead.
    writer = dcp.FileSystemWriter(str(checkpoint_dir), single_file_per_rank=False)
    progress = Progress(label, _nbytes(lazy_by_stand_in.values()))
    planner = _LazySavePlanner(lazy_by_stand_in, progress)
    with single_process_quietly():
        dcp.save(skeleton, storage_writer=writer, planner=planner, no_dist=True)
    progress.close()


def _walk_lazy(state, path=()):
    """(path, LazyTensor) for every LazyTensor leaf of a nested dict/list."""
    if isinstance(state, LazyTensor):
        yield path, state
    elif isinstance(state, dict | list):
        items = state.items() if isinstance(state, dict) else enumerate(state)
        for k, v in items:
            yield from _walk_lazy(v, (*path, k))


def _get(state, path):
    for k in path:
        state = state[k]
    return state


def _tensors_as_lazy(state):
    """Plain tensor leaves as LazyTensors too: the skeleton below reserves space for every
    storage, so each one's bytes must be written in the second pass."""
    if isinstance(state, torch.Tensor):
        return LazyTensor(tuple(state.shape), state.dtype, lambda: state)
    if isinstance(state, dict):
        return {k: _tensors_as_lazy(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_tensors_as_lazy(v) for v in state]
    return state


def _storage_records(path: Path | str) -> int:
    with zipfile.ZipFile(path) as z:
        return sum(n.rsplit("/", 2)[-2:-1] == ["data"] for n in z.namelist())


def torch_save_lazily(state, path: Path | str, label: str = "writing") -> None:
    """`torch.save(state, path)` with LazyTensor leaves made one at a time (on a terminal,
    progress lines start with `label`).

    torch.save writes a skeleton with space reserved for each storage (`skip_data`); loading
    that skeleton on the meta device tells each storage's byte offset, where the made tensor's
    bytes then go. The archive's CRC-32 fields stay those of the skeleton: `torch.load` does not
    check them, but a plain zip tool reports the data records as corrupt.
    """
    state = _tensors_as_lazy(state)
    leaves = list(_walk_lazy(state))
    with fake_tensor_mode():
        skeleton = _replace_lazy(state, lambda lz: torch.empty(lz.shape, dtype=lz.dtype))
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(skeleton, path)
    del skeleton
    if _storage_records(path) != len(leaves):
        raise ValueError("torch_save_lazily: a tensor sits inside a leaf that is not a dict or "
                         "list; its bytes would be lost")  # fmt: skip
    # Unpickling our own file: non-tensor leaves are whatever the caller passed (DCP blobs).
    placed = torch.load(path, map_location="meta", weights_only=False)
    progress = Progress(label, _nbytes(lazy for _, lazy in leaves))
    with open(path, "r+b") as f:
        for leaf_path, lazy in leaves:
            t = materialize(lazy)
            if t.numel():
                f.seek(storage_file_offset(_get(placed, leaf_path)))
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            progress.add(t.numel() * t.element_size())
            del t
        f.flush()
        os.fsync(f.fileno())
    progress.close()
