"""What this process may use of its host, and when it pauses for Python's garbage collector."""

import gc
import os
from pathlib import Path


def cpus_per_local_rank() -> int:
    """The CPUs this process may run on (taskset / cgroup pinning respected: cpu_count() reports
    the whole machine), shared evenly with the other ranks torchrun started on this host."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, (cpus or 1) // max(1, local_ranks))


def memory_per_local_rank(proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Bytes of host memory this process may still use: what the kernel says is available (free
    plus reclaimable cache), or less under a cgroup v2 limit (a container, a SLURM job's --mem),
    shared evenly with the other ranks torchrun started on this host. None off Linux."""
    try:
        fields = dict(line.split(":", 1) for line in Path(proc, "meminfo").read_text().splitlines())
        available = int(fields["MemAvailable"].split()[0]) * 1024  # the file says kB
    except (OSError, KeyError, ValueError):
        return None
    try:
        limit = Path(cgroup, "memory.max").read_text().strip()
        if limit != "max":
            available = min(available, int(limit) - int(Path(cgroup, "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


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
