"""Profiling: traces land at the documented path; snapshots degrade to a clear no-op on CPU."""

import logging
from types import SimpleNamespace

import pytest
import torch

from titanlite.profiling import NoOpProfiler, maybe_enable_memory_snapshot, maybe_enable_profiling


def _cfg(**kw):
    base = dict(
        enable_profiling=False,
        save_traces_folder="profile_traces",
        profile_freq=3,
        enable_memory_snapshot=False,
        save_memory_snapshot_folder="memory_snapshot",
    )
    return SimpleNamespace(**{**base, **kw})


def _train_steps(prof, steps, first=1):
    a = torch.randn(32, 32)
    for step in range(first, first + steps):
        with torch.profiler.record_function(f"train_step_{step}"):
            (a @ a).sum()
        prof.step()


def test_disabled_is_noop(tmp_path):
    with maybe_enable_profiling(_cfg(), str(tmp_path)) as prof:
        assert isinstance(prof, NoOpProfiler)
        _train_steps(prof, 4)
    with maybe_enable_memory_snapshot(_cfg(), str(tmp_path)) as snap:
        assert isinstance(snap, NoOpProfiler)
    assert not any(tmp_path.iterdir())


def test_profiler_writes_trace_at_step(tmp_path):
    with maybe_enable_profiling(_cfg(enable_profiling=True), str(tmp_path), rank=1) as prof:
        _train_steps(prof, 7)
    traces = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.json"))
    assert traces == [
        "profile_traces/iteration_3/rank1_trace.json",
        "profile_traces/iteration_6/rank1_trace.json",
    ]
    # The directory is named after the step whose work the trace holds.
    trace = (tmp_path / traces[0]).read_text()
    assert "train_step_3" in trace and "train_step_2" not in trace


def test_profiler_resume_keeps_iteration_numbers(tmp_path):
    with maybe_enable_profiling(_cfg(enable_profiling=True), str(tmp_path), global_step=4) as prof:
        _train_steps(prof, 3, first=5)
    traces = [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.json")]
    assert traces == ["profile_traces/iteration_6/rank0_trace.json"]


def test_profile_freq_too_small(tmp_path):
    with (
        pytest.raises(ValueError, match="profile_freq=1"),
        maybe_enable_profiling(_cfg(enable_profiling=True, profile_freq=1), str(tmp_path)),
    ):
        pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_memory_snapshot_on_cpu_warns_and_noops(tmp_path, caplog):
    with (
        caplog.at_level(logging.WARNING, logger="titanlite.profiling"),
        maybe_enable_memory_snapshot(_cfg(enable_memory_snapshot=True), str(tmp_path)) as snap,
    ):
        assert isinstance(snap, NoOpProfiler)
        _train_steps(snap, 4)
    assert [r.getMessage() for r in caplog.records] == [
        "memory snapshots need CUDA; none on this machine, so none will be written"
    ]
    assert not any(tmp_path.iterdir())
