"""Optional torch.profiler traces and CUDA memory snapshots, as context managers.

Both yield an object with `.step()` that the training loop calls once after every step. When the
feature is off (or, for snapshots, there is no CUDA) that object is a no-op, so the loop has no
`if` and pays one empty method call per step.
"""

import contextlib
import logging
import os
import pickle
import time
import warnings
from collections.abc import Iterator

import torch

from titanlite.config import ConfigError
from titanlite.torch_compat import cuda_memory_snapshot, record_cuda_memory_history

logger = logging.getLogger(__name__)

# Profile one step after one warm-up step per profile_freq: enough for a trace, cheap elsewhere.
_WARMUP_STEPS = 1
_ACTIVE_STEPS = 1
# Allocation events kept by the CUDA memory history (the torchtitan default): bounds host memory.
_SNAPSHOT_MAX_ENTRIES = 100_000


class NoOpProfiler:
    """Stands in for a profiler when profiling is off."""

    def step(self) -> None:
        pass


@contextlib.contextmanager
def maybe_enable_profiling(
    profiling_cfg, dump_folder: str, global_step: int = 0, rank: int = 0
) -> Iterator:
    """torch.profiler over the last step of every profile_freq steps, or a NoOpProfiler.

    Traces go to {dump_folder}/{save_traces_folder}/iteration_{N}/rank{rank}_trace.json where N
    is the training step traced. global_step is the step a resumed run starts after, so traces
    stay on multiples of profile_freq.
    """
    if not profiling_cfg.enable_profiling:
        yield NoOpProfiler()
        return
    freq = profiling_cfg.profile_freq
    wait = freq - _WARMUP_STEPS - _ACTIVE_STEPS
    if wait < 0:
        raise ConfigError(
            f"profiling.profile_freq={freq} is too small: the profiler needs "
            f"{_WARMUP_STEPS + _ACTIVE_STEPS} steps (warm-up + active); set it to at least that."
        )
    trace_dir = os.path.join(dump_folder, profiling_cfg.save_traces_folder)

    def on_trace_ready(prof) -> None:
        # step() has already counted the traced step, so step_num is that step's number.
        step_dir = os.path.join(trace_dir, f"iteration_{prof.step_num}")
        os.makedirs(step_dir, exist_ok=True)
        begin = time.monotonic()
        prof.export_chrome_trace(os.path.join(step_dir, f"rank{rank}_trace.json"))
        logger.info(
            f"Profiler trace of step {prof.step_num} written in {time.monotonic() - begin:.2f} s"
        )

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    logger.info(f"Profiling on: a trace every {freq} steps in {trace_dir}")
    # Each cycle is exported on its own, so torch's notice that events are cleared per cycle
    # (printed on the first trace) only adds noise to the training log.
    warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
    schedule = torch.profiler.schedule(wait=wait, warmup=_WARMUP_STEPS, active=_ACTIVE_STEPS)
    with torch.profiler.profile(
        activities=activities,
        schedule=schedule,
        on_trace_ready=on_trace_ready,
        record_shapes=True,
    ) as prof:
        # The schedule is evaluated at step_num; starting it at global_step keeps a resumed run
        # on the same iteration numbers as an uninterrupted one.
        prof.step_num = global_step
        yield prof


class _MemorySnapshotter:
    """Records CUDA allocator history; dumps a snapshot every `freq` steps."""

    def __init__(self, snapshot_dir: str, freq: int, global_step: int, rank: int):
        self.snapshot_dir = snapshot_dir
        self.freq = freq
        self.step_num = global_step
        self.rank = rank
        record_cuda_memory_history(_SNAPSHOT_MAX_ENTRIES)

    def step(self) -> None:
        self.step_num += 1
        if self.step_num % self.freq == 0:
            self.dump(f"iteration_{self.step_num}")

    def dump(self, dir_name: str) -> None:
        step_dir = os.path.join(self.snapshot_dir, dir_name)
        os.makedirs(step_dir, exist_ok=True)
        path = os.path.join(step_dir, f"rank{self.rank}_memory_snapshot.pickle")
        with open(path, "wb") as f:
            pickle.dump(cuda_memory_snapshot(), f)
        logger.info(f"Memory snapshot written to {path}")


@contextlib.contextmanager
def maybe_enable_memory_snapshot(
    profiling_cfg, dump_folder: str, global_step: int = 0, rank: int = 0
) -> Iterator:
    """CUDA memory snapshots every profile_freq steps, or a NoOpProfiler when off or on CPU.

    Snapshots go to {dump_folder}/{save_memory_snapshot_folder}/iteration_{N}/
    rank{rank}_memory_snapshot.pickle (open them at https://pytorch.org/memory_viz). On an
    out-of-memory error the history so far is dumped to iteration_{N}_exit before re-raising,
    which is the snapshot one most wants.
    """
    if not profiling_cfg.enable_memory_snapshot:
        yield NoOpProfiler()
        return
    if not torch.cuda.is_available():
        logger.warning("memory snapshots need CUDA; none on this machine, so none will be written")
        yield NoOpProfiler()
        return
    if profiling_cfg.profile_freq < 1:
        raise ConfigError(
            f"profiling.profile_freq={profiling_cfg.profile_freq} must be >= 1 for snapshots."
        )
    snapshot_dir = os.path.join(dump_folder, profiling_cfg.save_memory_snapshot_folder)
    logger.info(f"Memory snapshots on: every {profiling_cfg.profile_freq} steps in {snapshot_dir}")
    snapshotter = _MemorySnapshotter(snapshot_dir, profiling_cfg.profile_freq, global_step, rank)
    try:
        yield snapshotter
    except torch.OutOfMemoryError:
        # step_num counts finished steps, so the failing step is step_num + 1.
        snapshotter.dump(f"iteration_{snapshotter.step_num + 1}_exit")
        raise
    finally:
        record_cuda_memory_history(None)
