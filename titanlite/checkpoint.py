"""Checkpointing on torch.distributed.checkpoint (DCP): resharding, atomic, optionally async.

On disk, `{dump_folder}/{folder}/step-N/` holds the DCP files (`.metadata`, `__R_0.distcp`) and
a `COMPLETE` marker. A save writes into `step-N.tmp/`; once every rank has finished (DCP's final
gather has run), rank 0 writes the marker and renames the folder. A crash mid-save therefore
leaves only a `step-N.tmp/` (reported and ignored on load) and never touches an older checkpoint.

DCP keys: "model" and "optimizer" (from `get_state_dict`, so any FSDP/TP layout can load any other),
"lr_scheduler", "dataloader", "train_state", "meta" (pickled blobs, so their structure may change
between runs without confusing DCP's per-key planner) and "rng.rank{R}" (each rank's RNG states).
"""

import contextlib
import json
import logging
import pickle
import random
import re
import shutil
import signal
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

logger = logging.getLogger(__name__)

MARKER = "COMPLETE"
EXCLUDABLE = ("optimizer", "lr_scheduler", "dataloader", "train_state")
# What a run gets instead of a part it was told not to load.
_FRESH = {
    "optimizer": "the optimizer state starts fresh (zero moments)",
    "lr_scheduler": "the LR schedule starts from its first step (warmup again)",
    "dataloader": "the data starts again from its first batch, at the global position 0",
    "train_state": "training restarts at step 0 with this process's RNG",
}
_STEP_DIR = re.compile(r"^step-(\d+)(\.tmp)?$")


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _barrier() -> None:
    if _dist_on():
        dist.barrier()


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every call without a process group; one process is a supported case here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a")
        yield


def _dcp_reason(err: BaseException) -> str:
    """DCP wraps per-rank failures in a CheckpointException whose text is whole tracebacks;
    the last line carries the actual cause (e.g. "Size mismatch ... for model.w")."""
    lines = [ln for ln in str(err).splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(err).__name__


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


def _check_dcp_dir(path: Path, what: str) -> None:
    """Fail early, with the fix, when a path explicitly asked for is not a DCP checkpoint."""
    if not path.exists():
        raise ValueError(f"{what}: {path} does not exist")
    if (path / ".metadata").is_file():
        return
    if any(path.glob("*.safetensors")):
        raise ValueError(
            f"{what}: {path} is a Hugging Face checkpoint; convert it first with "
            f"`python scripts/convert_checkpoint.py hf-to-dcp {path} OUT_DIR` and load OUT_DIR"
        )
    steps = scan_checkpoints(path)[0]
    hint = (
        f" (it holds step folders; pick one, e.g. {path / f'step-{max(steps)}'})" if steps else ""
    )
    raise ValueError(f"{what}: {path} is not a DCP checkpoint: no .metadata file{hint}")


def _capture_rng() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state()}
    state["torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    """Save/load the whole training state; see the module docstring for the layout.

    `train_state`, `dataloader` and `lr_scheduler` only need `state_dict()`/`load_state_dict()`.
    Must be constructed on every rank (the async mode creates its own process group).
    """

    def __init__(
        self, ckpt_cfg, dump_folder, model, optimizer, lr_scheduler, dataloader, train_state,
        dp_rank: int = 0, dp_degree: int = 1,
    ):  # fmt: skip
        bad = sorted(set(ckpt_cfg.exclude_from_loading) - set(EXCLUDABLE))
        if bad:
            raise ValueError(
                f"checkpoint.exclude_from_loading has unknown parts {bad}; "
                f"allowed: {list(EXCLUDABLE)}"
            )
        if ckpt_cfg.async_mode not in ("disabled", "async"):
            raise ValueError(
                f"checkpoint.async_mode={ckpt_cfg.async_mode!r}; allowed: 'disabled', 'async'"
            )
        if ckpt_cfg.load_step >= 0 and not ckpt_cfg.enable:
            raise ValueError(f"checkpoint.load_step={ckpt_cfg.load_step} needs --checkpoint.enable")
        if ckpt_cfg.interval <= 0:
            raise ValueError(f"checkpoint.interval={ckpt_cfg.interval} must be > 0")
        self.cfg = ckpt_cfg
        self.folder = Path(dump_folder) / ckpt_cfg.folder
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.dataloader, self.train_state = dataloader, train_state
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self._pending = None  # (future, step) of the async save in flight
        self._last_saved = -1
        self._stop_flag = False
        # Facts item 8: an async save on the default PG collides with training collectives.
        self._pg = None
        if ckpt_cfg.async_mode == "async" and _dist_on():
            self._pg = dist.new_group(backend="gloo")

    # ---------------------------------------------------------------- save
    def maybe_save(self, step: int, last_step: bool = False) -> None:
        if self._pending is not None and self._pending[0].done():
            # Publish a finished async save now rather than at the next save, so a crash in
            # between does not leave a fully written checkpoint as an ignored `.tmp` folder.
            # Rank-local: DCP's future completes only after every rank's data is on disk.
            self.wait()
        if not self.cfg.enable or step == self._last_saved:
            return
        if step % self.cfg.interval == 0 or last_step:
            self.save(step)

    def save(self, step: int, model_only: bool = False) -> None:
        """Save `step`. Model only when asked (seed checkpoint) or before the first optimizer step:
        `get_state_dict` would otherwise initialize AdamW state with a zero-grad step()."""
        self.wait()
        model_only = model_only or self.optimizer is None or not self.optimizer.state
        tmp = self.folder / f"step-{step}.tmp"
        if _rank() == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save of this step
        _barrier()  # nobody writes into tmp before rank 0 has cleared it
        state = self._state_to_save(step, model_only)
        if self.cfg.async_mode == "async":
            fut = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._pg)
            self._pending = (fut, step)
        else:
            with _quiet_single_process():
                dcp.save(state, checkpoint_id=str(tmp))
            self._finalize(step)
        self._last_saved = step

    def wait(self) -> None:
        """Block until the async save in flight (if any) is written, then mark it complete."""
        if self._pending is None:
            return
        fut, step = self._pending
        self._pending = None
        try:
            fut.result()
        except (Exception, CheckpointException) as e:
            raise RuntimeError(
                f"async checkpoint save of step {step} to {self.folder / f'step-{step}.tmp'} "
                f"failed: {_dcp_reason(e)}; the previous checkpoints are untouched"
            ) from e
        self._finalize(step)

    def close(self) -> None:
        self.wait()
        if self._pg is not None:
            # Every rank's save is finished before any rank drops the group: gloo aborts a
            # process whose peer closes a connection it is still using.
            dist.barrier(group=self._pg)
            dist.destroy_process_group(self._pg)
            self._pg = None

    def _state_to_save(self, step: int, model_only: bool) -> dict:
        if model_only:
            state = {"model": get_model_state_dict(self.model)}
        else:
            msd, osd = get_state_dict(self.model, self.optimizer)
            loader_blob = pickle.dumps(self.dataloader.state_dict())
            self._check_same_on_all_ranks(loader_blob)  # DCP keeps one copy of equal keys
            state = {
                "model": msd,
                "optimizer": osd,
                "lr_scheduler": pickle.dumps(self.lr_scheduler.state_dict()),
                "dataloader": loader_blob,
                "train_state": pickle.dumps(self.train_state.state_dict()),
                "rng": {f"rank{_rank()}": pickle.dumps(_capture_rng())},
            }
        world = dist.get_world_size() if _dist_on() else 1
        meta = {"step": step, "model_only": model_only, "dp_degree": self.dp_degree}
        state["meta"] = pickle.dumps({**meta, "world_size": world})
        return state

    def _check_same_on_all_ranks(self, blob: bytes) -> None:
        if not _dist_on() or dist.get_world_size() == 1:
            return
        blobs = [None] * dist.get_world_size()
        dist.all_gather_object(blobs, blob)
        differ = [r for r, b in enumerate(blobs) if b != blobs[0]]
        if differ:
            raise RuntimeError(
                f"data loader state differs between rank 0 and ranks {differ}; it must be the "
                "global position, identical on every rank"
            )

    def _finalize(self, step: int) -> None:
        """Rank 0 only: every rank's data is on disk once DCP's save returned (its final gather
        ran), so publish the checkpoint, then prune. A complete checkpoint of the same step is
        moved aside first and deleted only after the new one took its place."""
        if _rank() != 0:
            return
        tmp, final = self.folder / f"step-{step}.tmp", self.folder / f"step-{step}"
        (tmp / MARKER).write_text(json.dumps({"step": step}) + "\n")
        old = self.folder / f"step-{step}.old"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        logger.info("Saved checkpoint %s", final)
        self._prune()

    def _prune(self) -> None:
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        complete = scan_checkpoints(self.folder)[0]
        for step in sorted(complete)[:-k]:
            shutil.rmtree(complete[step], ignore_errors=True)
            logger.info("Deleted old checkpoint %s (keep_latest_k=%d)", complete[step], k)

    # ---------------------------------------------------------------- load
    def load(self) -> int:
        """Restore the newest complete checkpoint (or `load_step`), else the model weights of
        `initial_load_path`. Returns the step to resume from: the checkpoint's step when the train
        state was restored, else 0 (fresh start, weights only, or train_state excluded)."""
        choice, err = None, None
        if self.cfg.enable and _rank() == 0:
            try:
                choice = self._choose_step_dir()
            except ValueError as e:
                err = str(e)
        if _dist_on():  # every rank loads rank 0's choice and fails with it, rather than hang
            box = [choice, err]
            dist.broadcast_object_list(box, src=0)
            choice, err = box
        if err:
            raise ValueError(err)
        if choice is not None:
            return self._load_from(Path(choice), weights_only=False)
        if self.cfg.initial_load_path:
            path = Path(self.cfg.initial_load_path)
            _check_dcp_dir(path, "checkpoint.initial_load_path")
            self._load_from(path, weights_only=True)
            return 0
        return 0

    def _choose_step_dir(self) -> str | None:
        complete, partial = scan_checkpoints(self.folder)
        for p in partial:
            logger.warning("Ignoring partial checkpoint %s (a save did not finish)", p)
        step = self.cfg.load_step
        if step >= 0:
            if step not in complete:
                raise ValueError(
                    f"checkpoint.load_step={step}: no complete checkpoint "
                    f"{self.folder}/step-{step}; complete steps there: {sorted(complete)}"
                )
            return str(complete[step])
        return str(complete[max(complete)]) if complete else None

    def _load_from(self, path: Path, weights_only: bool) -> int:
        _check_dcp_dir(path, "checkpoint")
        try:
            saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        except Exception as e:
            raise RuntimeError(
                f"cannot read checkpoint metadata {path / '.metadata'} ({e}): the checkpoint is "
                f"damaged; delete {path} to resume from an older one, or pick one with "
                "--checkpoint.load_step"
            ) from e
        meta = self._read(path, {"meta": b""})["meta"] if "meta" in saved else b""
        meta = pickle.loads(meta) if meta else {"model_only": True}
        parts = set() if weights_only or meta["model_only"] else set(EXCLUDABLE)
        parts -= set(self.cfg.exclude_from_loading)
        if not weights_only and not meta["model_only"]:
            for part in sorted(set(self.cfg.exclude_from_loading)):
                logger.warning(
                    "%s not loaded (checkpoint.exclude_from_loading): %s", part, _FRESH[part]
                )

        if "optimizer" in parts:
            msd, osd = get_state_dict(self.model, self.optimizer)
            state = {"model": msd, "optimizer": osd}
        else:
            state = {"model": get_model_state_dict(self.model)}
        self._check_model_shapes(path, saved, state["model"])
        for part in parts - {"optimizer"}:
            state[part] = b""
        rng_key = f"rank{_rank()}"
        if "train_state" in parts and f"rng.{rng_key}" in saved:
            state["rng"] = {rng_key: b""}
        state = self._read(path, state)

        if "optimizer" in parts:
            set_state_dict(
                self.model, self.optimizer,
                model_state_dict=state["model"], optim_state_dict=state["optimizer"],
            )  # fmt: skip
        else:
            set_model_state_dict(self.model, state["model"])
        if "lr_scheduler" in parts:
            self.lr_scheduler.load_state_dict(pickle.loads(state["lr_scheduler"]))
        if "dataloader" in parts:
            self.dataloader.load_state_dict(pickle.loads(state["dataloader"]))
            if meta["dp_degree"] != self.dp_degree:
                logger.info(
                    "Data loader position carries over from dp degree %d to %d (it is global)",
                    meta["dp_degree"], self.dp_degree,
                )  # fmt: skip
        if "train_state" in parts:
            self.train_state.load_state_dict(pickle.loads(state["train_state"]))
            if "rng" in state:
                _restore_rng(pickle.loads(state["rng"][rng_key]))
        logger.info("Loaded %s from %s", ", ".join(["model", *sorted(parts)]), path)
        return meta["step"] if "train_state" in parts else 0

    @staticmethod
    def _read(path: Path, state: dict) -> dict:
        try:
            with _quiet_single_process():
                dcp.load(state, checkpoint_id=str(path))
        except (Exception, CheckpointException) as e:
            raise RuntimeError(f"failed to load checkpoint {path}: {_dcp_reason(e)}") from e
        return state

    @staticmethod
    def _check_model_shapes(path: Path, saved: dict, msd: dict) -> None:
        """Name every missing or mis-shaped weight (e.g. a different model flavor) up front."""
        problems = []
        for name, t in msd.items():
            md = saved.get(f"model.{name}")
            if md is None:
                problems.append(f"{name}: missing")
            elif hasattr(md, "size") and tuple(md.size) != tuple(t.shape):
                problems.append(f"{name}: saved {tuple(md.size)}, model {tuple(t.shape)}")
        if problems:
            more = f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""
            raise ValueError(
                f"checkpoint {path} does not match the model (wrong flavor?): "
                f"{'; '.join(problems[:8])}{more}"
            )

    # ---------------------------------------------------------------- preemption
    def install_signal_handlers(self) -> None:
        """SIGTERM (scheduler kill) and SIGUSR1 (SLURM's preemption warning) only set a flag: the
        training step finishes, then `should_stop()` makes every rank save and exit together."""

        def handler(signum, frame):
            logger.warning("Got signal %d: will save a checkpoint and stop", signum)
            self._stop_flag = True

        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, handler)

    def should_stop(self) -> bool:
        """Collective when distributed: a signal may reach only some ranks, so take the MAX."""
        if not _dist_on() or dist.get_world_size() == 1:
            return self._stop_flag
        device = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
        flag = torch.tensor([int(self._stop_flag)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self._stop_flag = bool(flag.item())
        return self._stop_flag


def create_seed_checkpoint(ckpt_cfg, dump_folder, model) -> Path:
    """Single process: save freshly initialized weights as step-0 (model only), to be loaded and
    resharded by any parallel layout (facts 12b: CPU DTensor random init is not usable)."""
    if _dist_on() and dist.get_world_size() > 1:
        raise ValueError(
            "checkpoint.create_seed_checkpoint must run in a single process (no torchrun)"
        )
    mgr = CheckpointManager(ckpt_cfg, dump_folder, model, None, None, None, None)
    mgr.save(0, model_only=True)
    mgr.close()
    return mgr.folder / "step-0"
