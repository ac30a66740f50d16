"""titanlite.checkpoint.stream: lazily written checkpoints load like eagerly saved ones, and at
most two made tensors are alive at any time, however many the state holds."""

import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_nested_equal
from torch.distributed.checkpoint.api import CheckpointException

from titanlite.checkpoint.stream import (
    LazyTensor,
    save_lazily,
    single_process_quietly,
    torch_save_lazily,
)

N_LAZY = 12


class LiveStorages:
    """Makes tensors and tracks how many of their storages are alive at once. Storages, not
    tensor objects: DCP keeps `.detach()`ed views, which outlive the tensor that was made."""

    def __init__(self):
        self.alive = self.peak = self.made = 0

    def lazy(self, shape, dtype=torch.float32, seed=0) -> LazyTensor:
        def make():
            g = torch.Generator().manual_seed(seed)
            t = (torch.rand(shape, generator=g) * 100).to(dtype)
            self.alive += 1
            self.made += 1
            self.peak = max(self.peak, self.alive)
            weakref.finalize(t.untyped_storage(), self._freed)
            return t

        return LazyTensor(tuple(shape), dtype, make)

    def _freed(self):
        self.alive -= 1


def nested_state(tracker: LiveStorages) -> dict:
    layers = {f"layers.{i}.w": tracker.lazy((64, 32), seed=i) for i in range(N_LAZY - 2)}
    return {
        "model": {**layers, "norm": tracker.lazy((32,), torch.bfloat16, seed=99)},
        "step": tracker.lazy((), seed=7),  # 0-dim, as AdamW's step
        "train_state": b"\x00pickled",
        "small": torch.arange(5),
        "groups": [torch.ones(3), {"lr": 0.1}],
    }


def materialized(state):
    if isinstance(state, LazyTensor):
        return state.make()
    if isinstance(state, dict):
        return {k: materialized(v) for k, v in state.items()}
    if isinstance(state, list):
        return [materialized(v) for v in state]
    return state


def zeros_like_state(state):
    """A state to dcp.load into: same structure, placeholders of the right shapes."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like_state(v) for v in state]
    return b"" if isinstance(state, bytes) else 0.0


def test_save_lazily_loads_like_dcp_save(tmp_path):
    tracker = LiveStorages()
    state = nested_state(tracker)
    save_lazily(state, tmp_path / "lazy")
    expected = materialized(state)
    with single_process_quietly():
        dcp.save(expected, checkpoint_id=str(tmp_path / "eager"), no_dist=True)

    def saved(name):
        md = dcp.FileSystemReader(str(tmp_path / name)).read_metadata().state_dict_metadata
        return {k: getattr(v, "size", None) for k, v in md.items()}

    assert saved("lazy") == saved("eager")
    loaded = zeros_like_state(expected)
    with single_process_quietly():
        dcp.load(loaded, checkpoint_id=str(tmp_path / "lazy"), no_dist=True)
    assert_nested_equal(loaded, expected)


@pytest.mark.parametrize("save", [save_lazily, torch_save_lazily])
def test_at_most_two_made_tensors_are_alive(tmp_path, save):
    """Would be N_LAZY if every made tensor of the file were kept until the file is written."""
    tracker = LiveStorages()
    save(nested_state(tracker), tmp_path / "out")
    assert tracker.made == N_LAZY
    assert tracker.peak <= 2


def test_torch_save_lazily_loads_like_torch_save(tmp_path):
    state = nested_state(LiveStorages())
    state["empty"] = LazyTensor((0, 4), torch.float16, lambda: torch.empty(0, 4).half())
    torch_save_lazily(state, tmp_path / "lazy.pt")
    expected = materialized(state)
    assert_nested_equal(torch.load(tmp_path / "lazy.pt", weights_only=True), expected)
    mapped = torch.load(tmp_path / "lazy.pt", weights_only=True, mmap=True)
    assert_nested_equal(mapped, expected)


@pytest.mark.parametrize("save", [save_lazily, torch_save_lazily])
def test_make_must_keep_its_promise(tmp_path, save):
    state = {"w": LazyTensor((2, 3), torch.float32, lambda: torch.zeros(3, 2))}
    # DCP wraps the error in a CheckpointException that quotes it
    with pytest.raises(
        (ValueError, CheckpointException),
        match=r"promised \(2, 3\) torch.float32, make\(\) gave \(3, 2\)",
    ):
        save(state, tmp_path / "out")


def test_torch_save_lazily_refuses_tensors_it_cannot_reach(tmp_path):
    with pytest.raises(ValueError, match="not a dict or list"):
        torch_save_lazily({"pair": (torch.ones(2), 1)}, tmp_path / "out.pt")
