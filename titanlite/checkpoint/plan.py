"""What a run loads, decided and checked before the model is built (at 70B that build takes
minutes): its own newest (or chosen) complete checkpoint, else checkpoint.initial_load_path (a
DCP checkpoint or a Hugging Face folder), else nothing. Every wrong path fails here, with the fix,
and so does a damaged checkpoint (its files against the checksums its save recorded).
"""

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint import HuggingFaceStorageReader

from titanlite.checkpoint.integrity import recorded, verify
from titanlite.checkpoint.layout import (
    check_complete,
    dist_on,
    rank,
    read_marker,
    scan_checkpoints,
)
from titanlite.checkpoint.storage import checkpoint_folder, location, store
from titanlite.config import ConfigError
from titanlite.hf import read_hf_config

logger = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint that exists but cannot be read: the message names the path and the way out."""


@dataclass(frozen=True)
class LoadPlan:
    """What a run loads: its own newest (or chosen) checkpoint, or checkpoint.initial_load_path
    to start from (its weights only unless initial_load_model_only is off); `hf`: a Hugging
    Face folder (weights only)."""

    path: Path
    weights_only: bool
    hf: bool = False


def plan_load(ckpt_cfg, dump_folder) -> LoadPlan | None:
    """Decide what to load and check it can be loaded; rank 0 reads the folders and metadata,
    every rank gets its answer. With checkpoint.verify_on_load, every rank checks a share of a
    DCP checkpoint's files first (a damaged .metadata is named as such, not as unreadable)."""
    folder = checkpoint_folder(dump_folder, ckpt_cfg.folder)
    plan = rank0_decides(lambda: _choose(ckpt_cfg, folder))
    if plan is None:
        return None
    if ckpt_cfg.verify_on_load and not plan.hf:
        _verify(plan.path, own=plan.path.parent == folder)

    def readable():  # None: its answer, the metadata, is not needed yet (nor on every rank)
        (read_hf_metadata if plan.hf else read_metadata)(plan.path)

    rank0_decides(readable)
    return plan


def rank0_decides(decide):
    """`decide()` on rank 0 only (it reads files); every rank gets its answer (or its error)."""
    answer, err = None, None
    if rank() == 0:
        try:
            answer = decide()
        except (ValueError, CheckpointError) as e:
            err = e
    if dist_on():  # every rank fails with rank 0's error rather than hang waiting for it
        box = [answer, err]
        dist.broadcast_object_list(box, src=0)
        answer, err = box
    if err is not None:
        raise err
    return answer


def _choose(ckpt_cfg, folder: Path) -> LoadPlan | None:
    if ckpt_cfg.enable:
        complete, partial = scan_checkpoints(folder)
        for p in partial:
            logger.warning("Ignoring partial checkpoint %s (a save did not finish)", p)
        complete = _resume_points(complete, ckpt_cfg.load_step)
        step = ckpt_cfg.load_step
        if step >= 0 and step not in complete:
            raise ConfigError(
                f"checkpoint.load_step={step}: no complete checkpoint {folder}/step-{step}; "
                f"complete steps there: {sorted(complete)}"
            )
        if complete:
            return LoadPlan(complete[step if step >= 0 else max(complete)], weights_only=False)
    if ckpt_cfg.initial_load_path:
        path, hf = location(ckpt_cfg.initial_load_path), ckpt_cfg.initial_load_in_hf
        what = "checkpoint.initial_load_path"
        if not hf and path.is_dir() and _is_hf(path):
            raise ConfigError(
                f"{what}: {path} is a Hugging Face folder: add --checkpoint.initial_load_in_hf"
            )
        (_check_hf_dir if hf else _check_dcp_dir)(path, what)
        return LoadPlan(path, weights_only=ckpt_cfg.initial_load_model_only, hf=hf)
    return None


def _resume_points(complete: dict[int, Path], load_step: int) -> dict[int, Path]:
    """The complete checkpoints a run can resume from: not a last save that holds only the model
    weights (checkpoint.last_save_model_only), which has no optimizer or data state."""
    exports = {s: p for s, p in complete.items() if read_marker(p).get("model_only")}
    for step, path in sorted(exports.items()):
        hf = " --checkpoint.initial_load_in_hf" if read_marker(path).get("format") == "hf" else ""
        fix = f"start a run from it with --checkpoint.initial_load_path {path}{hf}"
        if step == load_step:
            raise ConfigError(
                f"checkpoint.load_step={step}: {path} holds only the model weights (a last "
                f"save with checkpoint.last_save_model_only), nothing to resume; {fix}"
            )
        logger.warning("Not resuming from %s: it holds only the model weights; %s", path, fix)
    return {s: p for s, p in complete.items() if s not in exports}


def _damaged_files(path: Path) -> list[str] | None:
    """Collective: `path`'s damaged files (empty: it verifies), None when it has no checksums."""
    checksums = rank0_decides(lambda: recorded(path))
    if checksums is None:
        logger.info("Not verifying %s: its marker records no checksums", path)
        return None
    t0 = time.perf_counter()
    damaged = verify(path, checksums)
    if not damaged:
        size = sum(f["size"] for f in checksums["files"].values())
        logger.info(
            "Verified %s: %d files, %.2f GiB in %.1f s",
            path, len(checksums["files"]), size / 2**30, time.perf_counter() - t0,
        )  # fmt: skip
    return damaged


def _verify(path: Path, own: bool) -> None:
    """On every rank, one CheckpointError when the checkpoint at `path` does not match its
    checksums: the damaged files, and for a run's own checkpoint the newest earlier one that
    verifies (checked only now, newest first: the user picks it, nothing falls back silently)."""
    damaged = _damaged_files(path)
    if not damaged:
        return
    more = f" (+{len(damaged) - 8} more)" if len(damaged) > 8 else ""
    msg = f"checkpoint {path} is damaged: {'; '.join(damaged[:8])}{more}"
    if own:
        msg += f"; {_newest_good_before(path)}"
    raise CheckpointError(msg)


def _newest_good_before(path: Path) -> str:
    step = int(path.name.removeprefix("step-"))

    def earlier():  # resumable: not a weights-only export
        complete = scan_checkpoints(path.parent)[0]
        steps = [s for s, p in complete.items() if not read_marker(p).get("model_only")]
        return sorted((s for s in steps if s < step), reverse=True)

    candidates = rank0_decides(earlier)
    for s in candidates:
        fix = f"resume from it with --checkpoint.load_step {s}"
        logger.info("Looking for an earlier checkpoint that verifies: step %d", s)
        damaged = _damaged_files(path.parent / f"step-{s}")
        if damaged is None:
            return f"the newest earlier checkpoint, step {s}, records no checksums to verify: {fix}"
        if not damaged:
            return f"the newest earlier checkpoint that verifies is step {s}: {fix}"
    if not candidates:
        return "there is no earlier checkpoint to resume from"
    return f"no earlier checkpoint verifies either (steps {', '.join(map(str, candidates))})"


def _is_hf(path: Path) -> bool:
    return not (path / ".metadata").is_file() and any(path.glob("*.safetensors"))


def _check_dcp_dir(path: Path, what: str) -> None:
    """Fail early, with the fix, when a path explicitly asked for is not a whole DCP checkpoint."""
    check_complete(path, what)
    if (path / ".metadata").is_file():
        return
    if _is_hf(path):
        raise ConfigError(
            f"{what}: {path} is a Hugging Face checkpoint; convert it first with "
            f"`python scripts/convert_checkpoint.py hf-to-dcp {path} OUT_DIR` and load OUT_DIR"
        )
    steps = scan_checkpoints(path)[0]
    hint = (
        f" (it holds step folders; pick one, e.g. {path / f'step-{max(steps)}'})" if steps else ""
    )
    raise ConfigError(f"{what}: {path} is not a DCP checkpoint: no .metadata file{hint}")


def _check_hf_dir(path: Path, what: str) -> None:
    """Fail early, with the fix, when a path asked for is not a loadable Hugging Face folder."""
    check_complete(path, what)
    if (path / ".metadata").is_file():
        raise ConfigError(
            f"{what}: {path} is a DCP checkpoint, not a Hugging Face folder: drop "
            "--checkpoint.initial_load_in_hf"
        )
    try:
        read_hf_config(path)
    except ValueError as e:
        raise ConfigError(f"{what}: {e}") from None


def read_metadata(path: Path) -> dict:
    """DCP's index of what the checkpoint holds: {key: tensor/bytes metadata}."""
    try:
        return store(path).reader(path).read_metadata().state_dict_metadata
    except Exception as e:
        raise CheckpointError(
            f"cannot read checkpoint metadata {path / '.metadata'} ({e}): the checkpoint is "
            f"damaged; delete {path} to resume from an older one, or pick one with "
            "--checkpoint.load_step"
        ) from e


def read_hf_metadata(path: Path) -> dict:
    """{HF name: tensor metadata} from the headers of a HF folder's safetensors files."""
    try:
        return HuggingFaceStorageReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:
        raise CheckpointError(f"cannot read the safetensors files in {path} ({e})") from e


def check_checkpoint_dir(path: Path, what: str) -> None:
    """For a script given a checkpoint folder (`what` names its option): fail in seconds, with
    the fix, unless it is a complete DCP checkpoint whose metadata reads."""
    _check_dcp_dir(path, what)
    read_metadata(path)
