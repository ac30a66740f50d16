"""Disk space for a save: warned about before writing, and named when a save fails.

What a save needs is the size of the newest complete checkpoint in the folder (the state's shapes
do not change during a run), or before the first one, this rank's share of the state times the
ranks (an upper bound: replicated shards are written once). What it has is the free space of the
folder's filesystem, as this rank sees it (object storage reports none: nothing is checked).
"""

import logging
from pathlib import Path

from titanlite.checkpoint.layout import rank, read_marker, scan_checkpoints, world_size
from titanlite.checkpoint.plan import CheckpointError
from titanlite.checkpoint.storage import store
from titanlite.distributed import local_value

logger = logging.getLogger(__name__)


def needed_bytes(folder: Path, state: dict) -> int:
    complete = {
        s: p for s, p in scan_checkpoints(folder)[0].items() if not read_marker(p).get("model_only")
    }
    if complete:
        newest = complete[max(complete)]
        # The sizes its marker recorded: one read, where asking each file (an object: a request
        # each) takes thousands at scale.
        recorded = (read_marker(newest).get("checksums") or {}).get("files")
        if recorded:
            return sum(entry["size"] for entry in recorded.values())
        return sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
    return _local_bytes(state) * world_size()


def _local_bytes(tree) -> int:
    if isinstance(tree, dict):
        return sum(_local_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_local_bytes(v) for v in tree)
    return getattr(local_value(tree), "nbytes", 0)


def _mib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def warn_if_short(folder: Path, step: int, needed: int) -> None:
    free = store(folder).free_bytes(folder)
    if free is not None and free < needed:
        logger.warning(
            "checkpoint step %d needs about %s in %s, which has %s free: the save will likely "
            "fail; free some space or lower checkpoint.keep_latest_k",
            step, _mib(needed), folder, _mib(free),
        )  # fmt: skip


def save_failed(folder: Path, step: int, needed: int, reason: str) -> CheckpointError:
    """The error of a failed save, after rank 0 removed its partial folder: what it needed, what
    is free, which checkpoints are left."""
    where = store(folder)
    tmp = where.save_path(folder, step)
    if rank() == 0:
        where.remove(tmp)
    free = where.free_bytes(folder)
    short = (
        "not enough space: free some, or lower checkpoint.keep_latest_k; "
        if free is not None and free < needed
        else ""
    )
    free_there = "an object store" if free is None else f"{_mib(free)} are free there"
    left = sorted(scan_checkpoints(folder)[0])
    kept = f"step {left[-1]} and earlier are untouched" if left else "no earlier checkpoint exists"
    return CheckpointError(
        f"checkpoint step {step} could not be written to {folder}: it needs about "
        f"{_mib(needed)} and {free_there} ({short}the partial {tmp.name} was "
        f"removed; {kept}). Writer: {reason}"
    )
