"""Checkpoint folders: step folders, their completion markers, publishing and pruning.

`{dump_folder}/{folder}/step-N/` (or `s3://.../step-N/`) holds one checkpoint (DCP files, or a
Hugging Face folder for a last save in HF) and a `COMPLETE` marker. `publish` completes a step
once every rank has finished writing it: on disk it renames `step-N.tmp/`, in object storage it
writes the marker last (storage.py). A crash mid-save leaves a partial step (reported and ignored
on load) and never touches an older checkpoint. Rank 0 alone touches the folders; `rank()` and
`world_size()` also answer without a process group. Folders are `Path`s or `UPath`s.
"""

import json
import logging
import re
from pathlib import Path

import torch.distributed as dist

from titanlite.checkpoint.storage import MARKER, store
from titanlite.config import ConfigError

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)(\.tmp)?$")


def dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if dist_on() else 0


def world_size() -> int:
    return dist.get_world_size() if dist_on() else 1


def scan_checkpoints(folder: Path) -> tuple[dict[int, Path], list[Path]]:
    """Complete checkpoints by step, and partial folders (an unfinished `.tmp` or no marker)."""
    complete, partial = {}, []
    if not folder.is_dir():
        return complete, partial
    for p in sorted(folder.iterdir()):
        m = _STEP_DIR.match(p.name)
        if not m or not p.is_dir():
            continue
        if m.group(2) is None and (p / MARKER).is_file():
            complete[int(m.group(1))] = p
        else:
            partial.append(p)
    return complete, partial


def read_marker(path: Path) -> dict:
    """What a complete checkpoint's marker says: `publish` writes JSON; a marker made by hand
    (an empty file) says only that the folder is complete."""
    try:
        return json.loads((path / MARKER).read_text() or "{}")
    except ValueError:
        return {}


def check_complete(path: Path, what: str) -> None:
    """A path explicitly asked for exists and, if it is a step folder, its save finished."""
    if not path.exists():
        raise ConfigError(f"{what}: {path} does not exist")
    step_dir = _STEP_DIR.match(path.name)
    if step_dir and (step_dir.group(2) or not (path / MARKER).is_file()):
        raise ConfigError(
            f"{what}: {path} is a partial checkpoint (its save did not finish: no {MARKER} "
            "marker); pick a complete step folder"
        )


def publish(folder: Path, step: int, info: dict | None = None) -> Path:
    """Mark step `step`, fully written, complete: its marker holds the step and `info`."""
    marker = json.dumps({"step": step, **(info or {})}) + "\n"
    return store(folder).publish(folder, step, marker)


def prune(folder: Path, keep_latest_k: int, keep: int) -> None:
    """Delete all but the newest `keep_latest_k` complete checkpoints (none when k <= 0), never
    step `keep` (the one just published: after a resume from an older step it may not be the
    newest). Weights-only exports neither count nor go: with k = 1 the last full checkpoint must
    survive the run's final export, or the run could not be resumed or extended."""
    k = keep_latest_k
    if k <= 0:
        return
    complete = scan_checkpoints(folder)[0]
    complete = {s: p for s, p in complete.items() if not read_marker(p).get("model_only")}
    for step in sorted(complete)[:-k]:
        if step != keep:
            store(folder).remove(complete[step])
            logger.info("Deleted old checkpoint %s (keep_latest_k=%d)", complete[step], k)
