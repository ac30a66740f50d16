import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from titanlite.host import GarbageCollection, cpus_per_local_rank, memory_per_local_rank

WORKER = Path(__file__).parent / "support" / "pinned_cpus.py"


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs CPU affinity")
@pytest.mark.parametrize("local_ranks, expected", [(None, 2), ("2", 1), ("4", 1)])
def test_cpus_follow_affinity_shared_by_local_ranks(local_ranks, expected):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs to pin to")
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_WORLD_SIZE"}
    if local_ranks:
        env["LOCAL_WORLD_SIZE"] = local_ranks
    # Pinned to 2 CPUs of however many the machine has: the count must follow the pinning.
    pin = sorted(os.sched_getaffinity(0))[:2]
    cmd = [sys.executable, str(WORKER), ",".join(map(str, pin))]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == expected


def test_at_least_one(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "100000")
    assert cpus_per_local_rank() == 1


@pytest.mark.parametrize("job_limit, step_limit, local_ranks, expected_gib", [
    ("max", "max", None, 8), ("max", "max", "2", 4), (str(7 << 30), "max", "2", 3),
    (str(16 << 30), "max", None, 8), ("max", str(3 << 30), None, 2),
    (str(4 << 30), str(9 << 30), None, 3),
])  # fmt: skip
def test_memory_is_the_least_room_of_host_and_cgroups_shared_by_local_ranks(
    tmp_path, monkeypatch, job_limit, step_limit, local_ranks, expected_gib
):
    """8 GiB available on the host; this process in cgroup job/step, which use 1 GiB and 1 GiB
    of the limits given (as SLURM nests a job's tasks under the group it limits)."""
    (tmp_path / "meminfo").write_text(f"MemTotal: {32 << 20} kB\nMemAvailable: {8 << 20} kB\n")
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "cgroup").write_text("0::/job/step\n")
    for folder, limit in ((tmp_path / "job", job_limit), (tmp_path / "job" / "step", step_limit)):
        folder.mkdir(parents=True)
        (folder / "memory.max").write_text(limit + "\n")
        (folder / "memory.current").write_text(f"{1 << 30}\n")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    if local_ranks:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    assert memory_per_local_rank(tmp_path, tmp_path) == expected_gib << 30


def test_memory_without_meminfo_is_unknown_and_without_a_cgroup_is_the_hosts(tmp_path):
    assert memory_per_local_rank(tmp_path / "none", tmp_path) is None
    (tmp_path / "meminfo").write_text(f"MemAvailable: {1 << 20} kB\n")
    assert memory_per_local_rank(tmp_path, tmp_path) == 1 << 30


def test_garbage_collection_runs_every_freq_steps_and_automatic_collection_comes_back(
    monkeypatch,
):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation))
    assert gc.isenabled()
    with GarbageCollection(3) as garbage:
        assert not gc.isenabled() and calls == [1]  # one collection on entry
        for step in range(1, 8):
            garbage.step(step)
    assert calls == [1, 1, 1] and gc.isenabled()  # steps 3 and 6


# Heap bytes (glibc's mallinfo2 `arena`) a freed 24 MiB tensor leaves behind, with or without
# keep_freed_memory() first: kept in the heap for reuse, or mapped and unmapped by itself.
_FREED_BLOCK = """
import ctypes, sys
import torch
from titanlite.host import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
took = keep_freed_memory() if sys.argv[1] == "keep" else None
before = libc.mallinfo2().arena
block = torch.ones(24 * 2**20 // 4)
del block
print(took, libc.mallinfo2().arena - before)
"""


def _freed_block(mode: str, env: dict) -> tuple[str, int]:
    cmd = [sys.executable, "-c", _FREED_BLOCK, mode]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(
    not hasattr(__import__("ctypes").CDLL(None), "mallinfo2"), reason="needs glibc >= 2.33"
)
def test_freed_memory_stays_in_the_heap_for_the_next_step_unless_the_user_set_malloc():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    assert _freed_block("keep", env) == ("True", pytest.approx(24 * 2**20, rel=0.01))
    # glibc's default: a block that large is mapped for itself and handed back when freed.
    assert _freed_block("default", env)[1] < 2**20
    # The user's own malloc settings win.
    user = dict(env, MALLOC_TRIM_THRESHOLD_=str(128 * 1024))
    assert _freed_block("keep", user) == ("False", pytest.approx(0, abs=2**20))
