"""Checkpointing on torch.distributed.checkpoint (DCP): resharding, atomic, optionally async.

On disk, `{dump_folder}/{folder}/step-N/` holds the DCP files (`.metadata`, `__R_0.distcp`) and
a `COMPLETE` marker. A save writes into `step-N.tmp/`; once every rank has finished (DCP's final
gather has run), a background thread of rank 0 writes the marker, renames the folder and only
then prunes. A crash mid-save therefore leaves only a `step-N.tmp/` (reported and ignored on load)
and never touches an older checkpoint.

DCP keys: "model" and "optimizer" (from `get_state_dict`, so any FSDP/TP layout can load any other),
"lr_scheduler", "dataloader", "train_state", "meta" (pickled blobs, so their structure may change
between runs without confusing DCP's per-key planner), "rng.rank{R}" (each rank's CPU RNG
states and its own GPU's) and, for a sharded data stream, "dataloader_stream.dp{R}" (dp rank R's
stream position; its TP peers write equal ones, DCP keeps one).
"""

import json
import logging
import pickle
import random
import re
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from titanlite.checkpoint_hf import check_heads, hf_names, load_hf, save_hf
from titanlite.checkpoint_stream import single_process_quietly
from titanlite.config import EXCLUDABLE, ConfigError
from titanlite.data.loader import dp_degree_changed
from titanlite.hf import read_hf_config
from titanlite.precision import DTYPES

try:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
except ImportError:  # torch < 2.9: every async save stages into fresh memory
    DefaultStager = None

logger = logging.getLogger(__name__)

MARKER = "COMPLETE"


class CheckpointError(RuntimeError):
    """A checkpoint that exists but cannot be read: the message names the path and the way out."""


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


def _marker(path: Path) -> dict:
    """What a complete checkpoint's marker says (older markers: nothing, or only the step)."""
    try:
        return json.loads((path / MARKER).read_text() or "{}")
    except ValueError:
        return {}


def _check_complete(path: Path, what: str) -> None:
    """A path explicitly asked for exists and, if it is a step folder, its save finished."""
    if not path.exists():
        raise ConfigError(f"{what}: {path} does not exist")
    step_dir = _STEP_DIR.match(path.name)
    if step_dir and (step_dir.group(2) or not (path / MARKER).is_file()):
        raise ConfigError(
            f"{what}: {path} is a partial checkpoint (its save did not finish: no {MARKER} "
            "marker); pick a complete step folder"
        )


def _is_hf(path: Path) -> bool:
    return not (path / ".metadata").is_file() and any(path.glob("*.safetensors"))


def _check_dcp_dir(path: Path, what: str) -> None:
    """Fail early, with the fix, when a path explicitly asked for is not a whole DCP checkpoint."""
    _check_complete(path, what)
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


def _read_metadata(path: Path) -> dict:
    """DCP's index of what the checkpoint holds: {key: tensor/bytes metadata}."""
    try:
        return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:
        raise CheckpointError(
            f"cannot read checkpoint metadata {path / '.metadata'} ({e}): the checkpoint is "
            f"damaged; delete {path} to resume from an older one, or pick one with "
            "--checkpoint.load_step"
        ) from e


def _check_hf_dir(path: Path, what: str) -> None:
    """Fail early, with the fix, when a path asked for is not a loadable Hugging Face folder."""
    _check_complete(path, what)
    if (path / ".metadata").is_file():
        raise ConfigError(
            f"{what}: {path} is a DCP checkpoint, not a Hugging Face folder: drop "
            "--checkpoint.initial_load_in_hf"
        )
    try:
        read_hf_config(path)
    except ValueError as e:
        raise ConfigError(f"{what}: {e}") from None


def _read_hf_metadata(path: Path) -> dict:
    """{HF name: tensor metadata} from the headers of a HF folder's safetensors files."""
    try:
        return HuggingFaceStorageReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:
        raise CheckpointError(f"cannot read the safetensors files in {path} ({e})") from e


def check_checkpoint_dir(path: Path, what: str) -> None:
    """For a script given a checkpoint folder (`what` names its option): fail in seconds, with
    the fix, unless it is a complete DCP checkpoint whose metadata reads."""
    _check_dcp_dir(path, what)
    _read_metadata(path)


@dataclass(frozen=True)
class LoadPlan:
    """What a run loads: its own newest (or chosen) checkpoint, or checkpoint.initial_load_path
    to start from (its weights only unless initial_load_model_only is off); `hf`: a Hugging
    Face folder (weights only)."""

    path: Path
    weights_only: bool
    hf: bool = False


def _rank0_decides(decide):
    """`decide()` on rank 0 only (it reads files); every rank gets its answer (or its error)."""
    answer, err = None, None
    if _rank() == 0:
        try:
            answer = decide()
        except (ValueError, CheckpointError) as e:
            err = e
    if _dist_on():  # every rank fails with rank 0's error rather than hang waiting for it
        box = [answer, err]
        dist.broadcast_object_list(box, src=0)
        answer, err = box
    if err is not None:
        raise err
    return answer


def plan_load(ckpt_cfg, dump_folder) -> LoadPlan | None:
    """Decide what to load and check it can be loaded, before the model is built (at 70B that
    build takes minutes)."""

    def decide():
        plan = _choose(ckpt_cfg, Path(dump_folder) / ckpt_cfg.folder)
        if plan is not None:
            (_read_hf_metadata if plan.hf else _read_metadata)(plan.path)
        return plan

    return _rank0_decides(decide)


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
        path, hf = Path(ckpt_cfg.initial_load_path), ckpt_cfg.initial_load_in_hf
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
    exports = {s: p for s, p in complete.items() if _marker(p).get("model_only")}
    for step, path in sorted(exports.items()):
        hf = " --checkpoint.initial_load_in_hf" if _marker(path).get("format") == "hf" else ""
        fix = f"start a run from it with --checkpoint.initial_load_path {path}{hf}"
        if step == load_step:
            raise ConfigError(
                f"checkpoint.load_step={step}: {path} holds only the model weights (a last "
                f"save with checkpoint.last_save_model_only), nothing to resume; {fix}"
            )
        logger.warning("Not resuming from %s: it holds only the model weights; %s", path, fix)
    return {s: p for s, p in complete.items() if s not in exports}


def _capture_rng() -> dict:
    """This rank's generators only: its CPU one and the one of the GPU it trains on. All visible
    GPUs' states would be restored by index and fail when a rerun sees fewer GPUs."""
    state = {"python": random.getstate(), "numpy": np.random.get_state()}
    state["torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def _restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" not in state or not torch.cuda.is_available():
        return
    device, cuda = torch.cuda.current_device(), state["cuda"]
    if isinstance(cuda, (list, tuple)):  # older checkpoints: every GPU the rank could see
        if len(cuda) != 1 and device >= len(cuda):
            logger.warning(
                "checkpoint holds RNG states for %d GPUs, none for cuda:%d: its CUDA RNG "
                "starts from this process's state", len(cuda), device,
            )  # fmt: skip
            return
        cuda = cuda[0] if len(cuda) == 1 else cuda[device]
    torch.cuda.set_rng_state(cuda, device)


def _stream_state(loader) -> dict | None:
    """The loader's per-rank stream position; None when its whole state is global."""
    stream_state_dict = getattr(loader, "stream_state_dict", None)
    return None if stream_state_dict is None else stream_state_dict()


def _reusable_stager():
    """Staging buffers kept across async saves: the first save allocates this rank's host copy
    of the state (pinned when it comes from a GPU, for fast device-to-host copies), later saves
    copy into it. Staging blocks the caller: the training step after `save()` updates the
    weights in place. Positional options: the last one was renamed between torch releases."""
    if DefaultStager is None:
        return None
    cuda = torch.cuda.is_available()
    return DefaultStager(StagingOptions(cuda, False, False, cuda))


# The optimizer's param groups keyed by parameter name, like its state: a list of groups would
# differ between pipeline stages (each holds other parameters) and DCP would keep one rank's.
_FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)


def _flat_optimizer(saved_keys) -> bool:
    """Whether a checkpoint's optimizer was saved flat (all but the earliest titanlite's)."""
    return "optimizer.param_groups.0.params" not in saved_keys


def publish(folder: Path, step: int, info: dict | None = None) -> Path:
    """Mark the fully written `step-N.tmp` complete (the marker holds the step and `info`) and
    make it `step-N`. A complete `step-N` already there is moved aside first and deleted only
    after the new one took its place."""
    tmp, final = folder / f"step-{step}.tmp", folder / f"step-{step}"
    (tmp / MARKER).write_text(json.dumps({"step": step, **(info or {})}) + "\n")
    old = folder / f"step-{step}.old"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


class CheckpointManager:
    """Save/load the whole training state; see the module docstring for the layout.

    `train_state`, `dataloader` and `lr_scheduler` only need `state_dict()`/`load_state_dict()`.
    A `dataloader` whose state is partly per rank (a sharded stream) also has
    `stream_state_dict()`: its dp rank's position, or None. The save of `last_step` (the run's
    last) follows checkpoint.last_save_model_only / last_save_in_hf. Must be constructed on every
    rank (the async mode creates its own process group).
    """

    def __init__(
        self, ckpt_cfg, dump_folder, model, optimizer, lr_scheduler, dataloader, train_state,
        dp_degree: int = 1, last_step: int = -1,
    ):  # fmt: skip
        self.cfg = ckpt_cfg
        self.folder = Path(dump_folder) / ckpt_cfg.folder
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.dataloader, self.train_state = dataloader, train_state
        self.dp_degree, self.last_step = dp_degree, last_step
        self._last_saved = -1
        # Publishing (marker, rename) and pruning (rmtree of terabytes at 405B) run in this
        # thread in both modes: on the training thread rank 0 would hold every other rank at
        # the next collective until they finish.
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="titanlite-ckpt")
        self._published: Future | None = None
        # An async save gets its own process group: on the default one its collectives would
        # interleave with the training step's and deadlock or time out.
        self._pg = self._stager = None
        if ckpt_cfg.async_mode == "async":
            self._stager = _reusable_stager()
            if _dist_on():
                self._pg = dist.new_group(backend="gloo")

    # ---------------------------------------------------------------- save
    def due(self, step: int, final: bool = False) -> bool:
        """Every `interval` steps, and at the run's last step (or a requested stop)."""
        if not self.cfg.enable or step == self._last_saved:
            return False
        return step % self.cfg.interval == 0 or final

    def save(self, step: int) -> None:
        """Save `step`; it is complete on disk once `wait()` or `close()` returned. Model only
        before the first optimizer step (a seed checkpoint): `get_state_dict` would otherwise
        initialize AdamW state with a zero-grad step(). The last step's save with
        last_save_model_only is an export: the weights in export_dtype, DCP or (last_save_in_hf)
        Hugging Face, written synchronously (the run ends right after it)."""
        self.wait()  # also: the staging buffers are free again, the previous write has read them
        export = step == self.last_step and self.cfg.last_save_model_only
        model_only = self.optimizer is None or not self.optimizer.state
        tmp = self.folder / f"step-{step}.tmp"
        if _rank() == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save of this step
        _barrier()  # nobody writes into tmp before rank 0 has cleared it
        if export:
            self._export(step, tmp)
        elif self.cfg.async_mode == "async":
            state = self._state_to_save(step, model_only)
            stager = {} if self._stager is None else {"async_stager": self._stager}
            written = dcp.async_save(
                state, checkpoint_id=str(tmp), process_group=self._pg, **stager
            )
            self._published = self._publisher.submit(self._publish_when_written, written, step)
        else:
            with single_process_quietly():
                dcp.save(self._state_to_save(step, model_only), checkpoint_id=str(tmp))
            self._published = self._publisher.submit(self._finalize, step)
        self._last_saved = step

    def _export(self, step: int, tmp: Path) -> None:
        fmt, dtype = "hf" if self.cfg.last_save_in_hf else "dcp", self.cfg.export_dtype
        if fmt == "hf":
            save_hf(self.model, tmp, dtype)
        else:
            state = self._state_to_save(step, model_only=True)
            state["model"] = {k: v.to(DTYPES[dtype]) for k, v in state["model"].items()}
            with single_process_quietly():
                dcp.save(state, checkpoint_id=str(tmp))
        info = {"model_only": True, "format": fmt, "dtype": dtype}
        self._published = self._publisher.submit(self._finalize, step, info)

    def _publish_when_written(self, written: Future, step: int) -> None:
        try:
            written.result()  # DCP completes it after every rank's data is on disk
        except (Exception, CheckpointException) as e:
            raise RuntimeError(
                f"async checkpoint save of step {step} to {self.folder / f'step-{step}.tmp'} "
                f"failed: {_dcp_reason(e)}; the previous checkpoints are untouched"
            ) from e
        self._finalize(step)

    def wait(self) -> None:
        """Block until the save in flight (if any) is written, published and old ones pruned."""
        if self._published is not None:
            published, self._published = self._published, None
            published.result()

    def close(self) -> None:
        self.wait()
        self._publisher.shutdown()
        if self._stager is not None:
            self._stager.close()  # frees the staging buffers (unpins them on CUDA)
            self._stager = None
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
            msd, osd = get_state_dict(self.model, self.optimizer, options=_FLAT_OPTIMIZER)
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
            stream = _stream_state(self.dataloader)
            if stream is not None:
                state["dataloader_stream"] = {f"dp{stream['dp_rank']}": pickle.dumps(stream)}
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

    def _finalize(self, step: int, info: dict | None = None) -> None:
        """Rank 0 only, in the publisher thread: every rank's data is on disk once DCP's save
        returned (its final gather ran), so publish the checkpoint, then prune. A complete
        checkpoint of the same step is moved aside first and deleted only after the new one
        took its place."""
        if _rank() != 0:
            return
        logger.info("Saved checkpoint %s", publish(self.folder, step, info))
        self._prune(keep=step)

    def _prune(self, keep: int) -> None:
        """Delete all but the newest `keep_latest_k` complete checkpoints, never step `keep`
        (the one just published: after a resume from an older step it may not be the newest).
        Weights-only exports neither count nor go: with k = 1 the last full checkpoint must
        survive the run's final export, or the run could not be resumed or extended."""
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        complete = scan_checkpoints(self.folder)[0]
        complete = {s: p for s, p in complete.items() if not _marker(p).get("model_only")}
        for step in sorted(complete)[:-k]:
            if step != keep:
                shutil.rmtree(complete[step], ignore_errors=True)
                logger.info("Deleted old checkpoint %s (keep_latest_k=%d)", complete[step], k)

    # ---------------------------------------------------------------- load
    def load(self, plan: "LoadPlan | None") -> int:
        """Restore what `plan_load` chose (nothing when None). Returns the step to resume from:
        the checkpoint's step when the train state was restored, else 0."""
        if plan is None:
            return 0
        if plan.hf:
            self._load_hf(plan.path)
            return 0
        return self._load_from(plan.path, plan.weights_only)

    def _load_hf(self, path: Path) -> None:
        args = self.model.args
        msd = get_model_state_dict(self.model)
        names = hf_names(args, msd)

        def check():  # the files' headers, read once (191 files at 405B), not by every rank
            check_heads(read_hf_config(path), args, path)
            self._check_model_shapes(path, _read_hf_metadata(path), msd, lambda n: names[n][0])

        _rank0_decides(check)
        try:
            load_hf(self.model, path)
        except (Exception, CheckpointException) as e:
            raise CheckpointError(f"failed to load {path}: {_dcp_reason(e)}") from e
        logger.info("Loaded model from %s (Hugging Face)", path)

    def _load_from(self, path: Path, weights_only: bool) -> int:
        saved = _read_metadata(path)
        meta = self._read(path, {"meta": b""})["meta"] if "meta" in saved else b""
        meta = pickle.loads(meta) if meta else {"model_only": True}
        parts = set() if weights_only or meta["model_only"] else set(EXCLUDABLE)
        parts -= set(self.cfg.exclude_from_loading)
        if not weights_only and not meta["model_only"]:
            for part in sorted(set(self.cfg.exclude_from_loading)):
                logger.warning(
                    "%s not loaded (checkpoint.exclude_from_loading): %s", part, _FRESH[part]
                )

        options = _FLAT_OPTIMIZER if _flat_optimizer(saved) else StateDictOptions()
        if "optimizer" in parts:
            msd, osd = get_state_dict(self.model, self.optimizer, options=options)
            state = {"model": msd, "optimizer": osd}
        else:
            state = {"model": get_model_state_dict(self.model)}
        self._check_model_shapes(path, saved, state["model"], lambda n: f"model.{n}")
        for part in parts - {"optimizer"}:
            state[part] = b""
        rng_key = f"rank{_rank()}"
        if "train_state" in parts and f"rng.{rng_key}" in saved:
            state["rng"] = {rng_key: b""}
        stream_key = self._stream_key(saved, meta) if "dataloader" in parts else None
        if stream_key is not None:
            state["dataloader_stream"] = {stream_key: b""}
        state = self._read(path, state)

        if "optimizer" in parts:
            set_state_dict(
                self.model, self.optimizer, options=options,
                model_state_dict=state["model"], optim_state_dict=state["optimizer"],
            )  # fmt: skip
        else:
            set_model_state_dict(self.model, state["model"])
        if "lr_scheduler" in parts:
            self.lr_scheduler.load_state_dict(pickle.loads(state["lr_scheduler"]))
        if "dataloader" in parts and stream_key is not None:
            stream = pickle.loads(state["dataloader_stream"][stream_key])
            self.dataloader.load_state_dict(pickle.loads(state["dataloader"]), stream)
        elif "dataloader" in parts:
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

    def _stream_key(self, saved: dict, meta: dict) -> str | None:
        """This dp rank's key under "dataloader_stream" when the loader is a sharded stream
        (None otherwise). Its position is per dp rank, so the dp degree must not change."""
        mine = _stream_state(self.dataloader)
        if mine is None:
            return None
        if meta["dp_degree"] != self.dp_degree:
            raise ConfigError(dp_degree_changed(meta["dp_degree"], self.dp_degree))
        key = f"dp{mine['dp_rank']}"
        # Absent: saved by a map-style run, whose global state the loader rejects with the fix.
        return key if f"dataloader_stream.{key}" in saved else None

    @staticmethod
    def _read(path: Path, state: dict) -> dict:
        try:
            with single_process_quietly():
                dcp.load(state, checkpoint_id=str(path))
        except (Exception, CheckpointException) as e:
            raise CheckpointError(f"failed to load checkpoint {path}: {_dcp_reason(e)}") from e
        return state

    @staticmethod
    def _check_model_shapes(path: Path, saved: dict, msd: dict, saved_key) -> None:
        """Name every missing or mis-shaped weight (e.g. a different model flavor) up front;
        `saved_key(name)` is the weight's key in the checkpoint."""
        problems = []
        for name, t in msd.items():
            md = saved.get(saved_key(name))
            if md is None:
                problems.append(f"{name}: missing")
            elif hasattr(md, "size") and tuple(md.size) != tuple(t.shape):
                problems.append(f"{name}: saved {tuple(md.size)}, model {tuple(t.shape)}")
        if problems:
            more = f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""
            raise ConfigError(
                f"checkpoint {path} does not match the model (wrong flavor?): "
                f"{'; '.join(problems[:8])}{more}"
            )
