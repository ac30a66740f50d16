"""The whole training state saved and loaded through torch.distributed.checkpoint (DCP):
resharding (any FSDP/TP/PP layout loads any other), atomic (see layout.py), optionally async.

DCP keys: "model" and "optimizer" (from `get_state_dict`, the optimizer's param groups keyed by
parameter name like its state: a list of groups would differ between pipeline stages, each holding
other parameters, and DCP would keep one rank's), "lr_scheduler", "dataloader", "train_state",
"meta" (pickled blobs, so their structure may change between runs without confusing DCP's per-key
planner), "rng.rank{R}" (each rank's CPU RNG states and its own GPU's) and, for a sharded data
stream, "dataloader_stream.dp{R}" (dp rank R's stream position; its TP peers write equal ones, DCP
keeps one). A checkpoint without "meta" (scripts/convert_checkpoint.py hf-to-dcp) holds weights
only.
"""

import logging
import pickle
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from titanlite.checkpoint.hf import check_heads, hf_names, load_hf, save_hf
from titanlite.checkpoint.integrity import checksummed_writer, record
from titanlite.checkpoint.layout import (
    MARKER,
    dist_on,
    prune,
    publish,
    rank,
    read_marker,
    world_size,
)
from titanlite.checkpoint.plan import (
    CheckpointError,
    LoadPlan,
    rank0_decides,
    read_hf_metadata,
    read_metadata,
)
from titanlite.checkpoint.space import needed_bytes, save_failed, warn_if_short
from titanlite.checkpoint.staging import ReusingStager
from titanlite.checkpoint.storage import checkpoint_folder, store
from titanlite.checkpoint.stream import single_process_quietly
from titanlite.config import EXCLUDABLE, ConfigError
from titanlite.data.stream import dp_degree_changed
from titanlite.hf import read_hf_config
from titanlite.precision import DTYPES
from titanlite.preemption import stop_grace_seconds, warn_if_slower_than_grace

logger = logging.getLogger(__name__)

# What a run gets instead of a part it was told not to load.
_FRESH = {
    "optimizer": "the optimizer state starts fresh (zero moments)",
    "lr_scheduler": "the LR schedule starts from its first step (warmup again)",
    "dataloader": "the data starts again from its first batch, at the global position 0",
    "train_state": "training restarts at step 0 with this process's RNG",
}
_FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)


def _barrier() -> None:
    if dist_on():
        dist.barrier()


def _dcp_reason(err: BaseException) -> str:
    """DCP wraps per-rank failures in a CheckpointException whose text is whole tracebacks;
    the last line carries the actual cause (e.g. "Size mismatch ... for model.w")."""
    lines = [ln for ln in str(err).splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(err).__name__


def _write_reason(writer, err: BaseException) -> str:
    """Why a save failed: DCP's reason, unless it does not name this rank's first failed file
    write, the cause (a full disk under DCP's own writer thread surfaces as torch.save's
    "unexpected pos" that followed it)."""
    reason, failures = _dcp_reason(err), writer.fs.failures
    return failures[0] if failures and failures[0] not in reason else reason


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
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], torch.cuda.current_device())


def _stream_state(loader) -> dict | None:
    """The loader's per-rank stream position; None when its whole state is global."""
    stream_state_dict = getattr(loader, "stream_state_dict", None)
    return None if stream_state_dict is None else stream_state_dict()


class CheckpointManager:
    """Save/load the whole training state: the DCP keys are in the module docstring, the folders
    in layout.py.

    `train_state`, `dataloader` and `lr_scheduler` only need `state_dict()`/`load_state_dict()`.
    A `dataloader` whose state is partly per rank (a sharded stream) also has
    `stream_state_dict()`: its dp rank's position, or None. The save of `last_step` (the run's
    last) follows checkpoint.last_save_model_only / last_save_in_hf. Must be constructed on every
    rank (the async mode creates its own process group).
    """

    def __init__(
        self, ckpt_cfg, dump_folder, model, optimizer, lr_scheduler, dataloader, train_state,
        dp_degree: int = 1, last_step: int = -1, n_layers: int | None = None,
        complete_export=None,
    ):  # fmt: skip
        """`n_layers`: the model's blocks on all pipeline stages; a checkpoint of more is
        refused (None: not checked). `complete_export(folder)`, on rank 0 after an HF export's
        weights and config.json: the tokenizer files and special ids (hf_export)."""
        self.cfg = ckpt_cfg
        self.folder = checkpoint_folder(dump_folder, ckpt_cfg.folder)  # a Path or a URL's UPath
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.dataloader, self.train_state = dataloader, train_state
        self.dp_degree, self.last_step, self.n_layers = dp_degree, last_step, n_layers
        self.complete_export = complete_export
        self._last_saved = -1
        self._grace_s = stop_grace_seconds(ckpt_cfg.stop_grace_seconds)
        self._save_started = 0.0  # the save in flight: from its call to its publication
        # Publishing (marker, rename) and pruning (rmtree of terabytes at 405B) run in this
        # thread in both modes: on the training thread rank 0 would hold every other rank at
        # the next collective until they finish.
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="titanlite-ckpt")
        self._published: Future | None = None
        self._staged: Future | None = None  # an async save's copy of the state, until waited for
        # An async save gets its own process group: on the default one its collectives would
        # interleave with the training step's and deadlock or time out.
        self.process_group = self._stager = None
        if ckpt_cfg.async_mode == "async":
            self._stager = ReusingStager()
            if dist_on():
                self.process_group = dist.new_group(backend="gloo")

    # ---------------------------------------------------------------- save
    def due(self, step: int, final: bool = False) -> bool:
        """Every `interval` steps, at the run's last step (or a requested stop), and at step 1
        with enable_first_step_checkpoint."""
        if not self.cfg.enable or step == self._last_saved:
            return False
        first = step == 1 and self.cfg.enable_first_step_checkpoint
        return step % self.cfg.interval == 0 or final or first

    def save(self, step: int) -> None:
        """Save `step`; it is complete on disk once `wait()` or `close()` returned. Model only
        before the first optimizer step (a seed checkpoint): `get_state_dict` would otherwise
        initialize AdamW state with a zero-grad step(). The last step's save with
        last_save_model_only is an export: the weights in export_dtype, DCP or (last_save_in_hf)
        Hugging Face, written synchronously (the run ends right after it)."""
        self.wait()  # also: the staging buffers are free again, the previous write has read them
        self._save_started = time.monotonic()
        export = step == self.last_step and self.cfg.last_save_model_only
        model_only = self.optimizer is None or not self.optimizer.state
        where = store(self.folder)
        tmp = where.save_path(self.folder, step)
        if rank() == 0:
            where.begin_save(self.folder, step)  # leftovers of a crashed save of this step go
        _barrier()  # nobody writes into tmp before rank 0 has cleared it
        if export:
            self._export(step, tmp)
            self._last_saved = step
            return
        state = self._state_to_save(step, model_only)
        # Rank 0 alone reads the folder (the newest checkpoint's size) and reports on space.
        needed = needed_bytes(self.folder, state) if rank() == 0 else 0
        if rank() == 0:
            warn_if_short(self.folder, step, needed)
        writer = checksummed_writer(tmp)  # hashes each file as it is written
        if self.cfg.async_mode == "async":
            # The stager copies in a thread of its own: DCP answers with two Futures, the copy
            # (the state may change once it is done) and the write.
            response = dcp.async_save(
                state, storage_writer=writer, process_group=self.process_group,
                async_stager=self._stager,
            )  # fmt: skip
            self._staged = response.staging_completion
            self._published = self._publisher.submit(
                self._publish_when_written, response.upload_completion, writer, step, needed
            )
        else:
            try:
                with single_process_quietly():
                    dcp.save(state, storage_writer=writer)
            except CheckpointException as e:  # raised on every rank: DCP reduces the failures
                raise save_failed(self.folder, step, needed, _write_reason(writer, e)) from e
            checksums = record(writer)
            self._published = self._publisher.submit(self._finalize, step, {"checksums": checksums})
        self._last_saved = step

    def _export(self, step: int, tmp: Path) -> None:
        fmt, dtype = "hf" if self.cfg.last_save_in_hf else "dcp", self.cfg.export_dtype
        info = {"model_only": True, "format": fmt, "dtype": dtype}
        if fmt == "hf":
            save_hf(self.model, tmp, dtype)
            if rank() == 0 and self.complete_export is not None:
                self.complete_export(tmp)
        else:
            state = self._state_to_save(step, model_only=True)
            state["model"] = {k: v.to(DTYPES[dtype]) for k, v in state["model"].items()}
            writer = checksummed_writer(tmp)
            with single_process_quietly():
                dcp.save(state, storage_writer=writer)
            info["checksums"] = record(writer)
        self._published = self._publisher.submit(self._finalize, step, info)

    def _publish_when_written(self, written: Future, writer, step: int, needed: int) -> None:
        """Every rank, in its publisher thread. The checksums' gather runs on the save's own
        group, where its collectives and the next save's never overlap: save() waits for this
        thread first."""
        try:
            written.result()  # DCP completes it after every rank's data is on disk
        except (Exception, CheckpointException) as e:
            reason = _write_reason(writer, e)
            raise save_failed(self.folder, step, needed, f"async: {reason}") from e
        self._finalize(step, {"checksums": record(writer, self.process_group)})

    def wait_for_staging(self) -> None:
        """Block until the async save in flight (if any) has copied the state it saves: call it
        before changing weights or optimizer state in place. The trainer does, before its next
        optimizer step, so the copy overlaps that step's forward and backward."""
        if self._staged is not None:
            staged, self._staged = self._staged, None
            staged.result()

    def wait(self) -> None:
        """Block until the save in flight (if any) is written, published and old ones pruned."""
        self.wait_for_staging()
        if self._published is not None:
            published, self._published = self._published, None
            published.result()

    def close(self) -> None:
        self.wait()
        self._publisher.shutdown()
        if self._stager is not None:
            self._stager.close()  # frees the staging buffers (unpins them on CUDA)
            self._stager = None
        if self.process_group is not None:
            # Every rank's save is finished before any rank drops the group: gloo aborts a
            # process whose peer closes a connection it is still using.
            dist.barrier(group=self.process_group)
            dist.destroy_process_group(self.process_group)
            self.process_group = None

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
                "rng": {f"rank{rank()}": pickle.dumps(_capture_rng())},
            }
            stream = _stream_state(self.dataloader)
            if stream is not None:
                state["dataloader_stream"] = {f"dp{stream['dp_rank']}": pickle.dumps(stream)}
        meta = {"step": step, "model_only": model_only, "dp_degree": self.dp_degree}
        state["meta"] = pickle.dumps({**meta, "world_size": world_size()})
        return state

    def _check_same_on_all_ranks(self, blob: bytes) -> None:
        if world_size() == 1:
            return
        blobs = [None] * world_size()
        dist.all_gather_object(blobs, blob)
        differ = [r for r, b in enumerate(blobs) if b != blobs[0]]
        if differ:
            raise RuntimeError(
                f"data loader state differs between rank 0 and ranks {differ}; it must be the "
                "global position, identical on every rank"
            )

    def _finalize(self, step: int, info: dict | None = None) -> None:
        """Rank 0 only, in the publisher thread: every rank's data is on disk once DCP's save
        returned (its final gather ran), so publish the checkpoint (`info`, the checksums among
        it, goes into its marker), then prune."""
        if rank() != 0:
            return
        seconds = time.monotonic() - self._save_started
        info = {**(info or {}), "save_seconds": round(seconds, 2)}
        logger.info("Saved checkpoint %s in %.1f s", publish(self.folder, step, info), seconds)
        warn_if_slower_than_grace(seconds, self._grace_s, f"the save of step {step}")
        prune(self.folder, self.cfg.keep_latest_k, keep=step)

    # ---------------------------------------------------------------- load
    def load(self, plan: LoadPlan | None) -> int:
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
            saved = read_hf_metadata(path)
            self._check_model_shapes(path, saved, msd, lambda n: names[n][0])
            self._check_no_extra_blocks(path, saved, args.n_layers)

        rank0_decides(check)
        try:
            load_hf(self.model, path)
        except (Exception, CheckpointException) as e:
            raise CheckpointError(f"failed to load {path}: {_dcp_reason(e)}") from e
        logger.info("Loaded model from %s (Hugging Face)", path)

    def _load_from(self, path: Path, weights_only: bool) -> int:
        saved = read_metadata(path)
        meta = self._read(path, {"meta": b""})["meta"] if "meta" in saved else b""
        meta = pickle.loads(meta) if meta else {"model_only": True}
        parts = self._parts_to_load(weights_only or meta["model_only"])
        if "optimizer" in parts:
            msd, osd = get_state_dict(self.model, self.optimizer, options=_FLAT_OPTIMIZER)
            state = {"model": msd, "optimizer": osd}
        else:
            state = {"model": get_model_state_dict(self.model)}
        self._check_model_shapes(path, saved, state["model"], lambda n: f"model.{n}")
        if self.n_layers is not None:
            self._check_no_extra_blocks(path, saved, self.n_layers)
        for part in parts - {"optimizer"}:
            state[part] = b""
        rng_key = f"rank{rank()}"  # none for a rank the saving run did not have
        if "train_state" in parts and f"rng.{rng_key}" in saved:
            state["rng"] = {rng_key: b""}
        stream_key = self._stream_key(saved, meta) if "dataloader" in parts else None
        if stream_key is not None:
            state["dataloader_stream"] = {stream_key: b""}
        self._apply(self._read(path, state), parts, meta, rng_key, stream_key)
        logger.info("Loaded %s from %s", ", ".join(["model", *sorted(parts)]), path)
        # A folder made by the converter (hf-to-dcp) has no marker, nor a save time.
        saved_in = read_marker(path).get("save_seconds") if (path / MARKER).is_file() else None
        if rank() == 0 and saved_in is not None:  # the last save, before this run spends time
            warn_if_slower_than_grace(saved_in, self._grace_s, f"the save of {path.name}")
        return meta["step"] if "train_state" in parts else 0

    def _parts_to_load(self, model_only: bool) -> set[str]:
        """What besides the model this load restores: nothing for weights alone, else every
        part the checkpoint has but those checkpoint.exclude_from_loading names (each said)."""
        if model_only:
            return set()
        for part in sorted(set(self.cfg.exclude_from_loading)):
            logger.warning(
                "%s not loaded (checkpoint.exclude_from_loading): %s", part, _FRESH[part]
            )
        return set(EXCLUDABLE) - set(self.cfg.exclude_from_loading)

    def _apply(
        self, state: dict, parts: set[str], meta: dict, rng_key: str, stream_key: str | None
    ) -> None:
        """Put what was read into the model and the parts being restored."""
        if "optimizer" in parts:
            set_state_dict(
                self.model, self.optimizer, options=_FLAT_OPTIMIZER,
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
                dcp.load(state, storage_reader=store(path).reader(path))
        except (Exception, CheckpointException) as e:
            raise CheckpointError(f"failed to load checkpoint {path}: {_dcp_reason(e)}") from e
        return state

    @staticmethod
    def _check_no_extra_blocks(path: Path, saved: dict, n_layers: int) -> None:
        """A checkpoint of more blocks than the model (a smaller flavor by mistake) would load
        its first blocks and drop the rest unsaid: every weight the model asks for is there.
        Block weights are `model.layers.<i>.*` in titanlite's and in Hugging Face's names."""
        blocks = {int(k.split(".")[2]) for k in saved if k.startswith("model.layers.")}
        if blocks and max(blocks) >= n_layers:
            raise ConfigError(
                f"checkpoint {path} holds {max(blocks) + 1} blocks, the model {n_layers} (wrong "
                "flavor?): pick the flavor it was saved with"
            )

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
