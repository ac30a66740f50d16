"""What this process may use of its host."""

import os


def cpus_per_local_rank() -> int:
    """The CPUs this process may run on (taskset / cgroup pinning respected: cpu_count() reports
    the whole machine), shared evenly with the other ranks torchrun started on this host."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, (cpus or 1) // max(1, local_ranks))
