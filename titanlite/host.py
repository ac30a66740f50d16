"""What this process may use of its host, how its allocator keeps memory, and when it pauses for
Python's garbage collector."""

import ctypes
import gc
import os
from pathlib import Path

# mallopt parameters (glibc's malloc.h); the largest mmap threshold glibc takes on 64 bits, and
# the largest trim threshold a C int holds.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 * 2**20
_TRIM_THRESHOLD_MAX = 2**31 - 1


def cpus_per_local_rank() -> int:
    """The CPUs this process may run on (taskset / cgroup pinning respected: cpu_count() reports
    the whole machine), shared evenly with the other ranks torchrun started on this host."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, (cpus or 1) // max(1, local_ranks))


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep the memory a training step frees for the next step, as a GPU's
    caching allocator does. A CPU step frees and allocates again the same large tensors each time
    (FSDP's gathered weights and gradient buffers, activations); glibc hands blocks beyond its
    mmap and trim thresholds back to the kernel, and the next step takes a page fault for each of
    their pages: on a ~100M model in bf16, 110-280 thousand a step (0.4-1.1 GB) and ~7% of it.
    Now blocks up to glibc's ceiling (32 MiB) come from the heap, which is trimmed only past 2 GiB
    free: the process keeps its peak resident, as a GPU keeps its reserved memory. Larger blocks
    are still mapped per allocation. An explicit MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_
    is the user's choice and wins. Returns whether the setting took (False off glibc)."""
    if {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & os.environ.keys():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    kept = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
    return bool(kept and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_MAX))


def memory_per_local_rank(proc: str = "/proc", cgroups: str = "/sys/fs/cgroup") -> int | None:
    """Bytes of host memory this process may still use: what the kernel says is available (free
    plus reclaimable cache), or less where a cgroup v2 limit leaves less room (a container, a
    SLURM job's --mem), shared evenly with the other ranks torchrun started on this host. None
    off Linux."""
    try:
        fields = dict(line.split(":", 1) for line in Path(proc, "meminfo").read_text().splitlines())
        available = int(fields["MemAvailable"].split()[0]) * 1024  # the file says kB
    except (OSError, KeyError, ValueError):
        return None
    room = _cgroup_room(proc, Path(cgroups))
    if room is not None:
        available = min(available, room)
    return available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def _cgroup_room(proc: str, root: Path) -> int | None:
    """The least room (limit less usage) of this process's cgroup v2 group and the groups above
    it: SLURM limits the job's group, while its tasks run in groups below. None if no limit."""
    try:
        lines = Path(proc, "self", "cgroup").read_text().splitlines()
        group = root / next(line[3:] for line in lines if line.startswith("0::")).strip("/")
    except (OSError, StopIteration):
        return None
    rooms = []
    for folder in [group, *group.parents]:
        try:
            limit = (folder / "memory.max").read_text().strip()
            if limit != "max":
                rooms.append(int(limit) - int((folder / "memory.current").read_text()))
        except (OSError, ValueError):
            pass
        if folder == root:
            break
    return min(rooms, default=None)


class GarbageCollection:
    """Python's automatic collection off; a young-generation collection every `freq` steps
    instead. Automatic collections pause each rank at its own moment, and the others wait for
    it at the next collective: on many ranks that is a straggler every few steps. Collected on
    the same steps everywhere, the pauses overlap. A context: automatic collection is back on
    leaving it."""

    def __init__(self, freq: int):
        self.freq = freq

    def __enter__(self):
        gc.disable()
        gc.collect(1)
        return self

    def step(self, step: int) -> None:
        if step % self.freq == 0:
            gc.collect(1)

    def __exit__(self, *exc) -> None:
        gc.enable()
