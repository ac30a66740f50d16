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
