"""Where logged metrics go besides the console: TensorBoard, a JSONL file, Weights & Biases;
and the record of the samples each step trained on (debug.log_sample_ids).

Each sink takes a step's values as Python floats (None = not measured this step) and writes them
under one naming: the JSONL keys as given, TensorBoard and W&B under the tags below.
"""

import hashlib
import json
import os
import re
import uuid
from pathlib import Path
from typing import Protocol

from titanlite.config import ConfigError

# Keys every JSONL record has (null when not given), with their TensorBoard names.
TB_TAGS = {
    "loss": "loss/global",
    "grad_norm": "grad_norm",
    "lr": "lr",
    "wps": "throughput/wps",
    "tflops": "throughput/tflops",
    "mfu": "mfu_pct",
    "memory_gib": "memory/max_reserved_gib",
    "alloc_retries": "memory/alloc_retries",
    "ooms": "memory/ooms",
    "data_time_pct": "time/data_pct",
    "elapsed_s": "time/elapsed_s",
    "tokens_seen": "tokens_seen",  # global batch x seq_len per step so far (the train state's)
}
_OPTIONALTB_TAGS = {
    "memory_active_gib": "memory/max_active_gib",  # CUDA only
    "slow_rank": "slow_rank/rank",  # world > 1: the rank whose own work lags the most,
    "slow_rank_lag_pct": "slow_rank/lag_pct",  # by this % of a step over the median rank,
    "slow_rank_data_lag_pct": "slow_rank/data_lag_pct",  # this much of it in data loading
    "val_loss": "loss/validation",
    "val_ppl": "ppl/validation",
    # First logged step only: what the planner predicted for this run, and what it needs to
    # set the prediction beside the measurements (plan --calibrate).
    "predicted_step_s": "plan/predicted_step_s",
    "predicted_memory_gib": "plan/predicted_memory_gib",
    "world_size": "plan/world_size",
    "vocab_size": "plan/vocab_size",
}


# A mixture's per-source keys (loss/<name> is its own tag, beside loss/global).
_PREFIX_TAGS = {"val_loss/": "loss/validation/"}


def _tag(key: str) -> str:
    if tag := TB_TAGS.get(key) or _OPTIONALTB_TAGS.get(key):
        return tag
    for prefix, tag in _PREFIX_TAGS.items():
        if key.startswith(prefix):
            return tag + key.removeprefix(prefix)
    return key


def tagged(floats: dict) -> dict[str, float]:
    """What TensorBoard and W&B get: each value under its TensorBoard tag, None left out."""
    return {_tag(key): value for key, value in floats.items() if value is not None}


class Sink(Protocol):
    """Where a logged step goes besides the console: `floats` holds Python floats or None."""

    def write(self, step: int, floats: dict[str, float | None]) -> None: ...

    def close(self, exit_code: int) -> None: ...


class TensorBoardSink:
    def __init__(self, folder: Path):
        # Imported here: tensorboard is slow to import and ranks that do not log skip it.
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(folder))

    def write(self, step: int, floats: dict) -> None:
        for tag, value in tagged(floats).items():
            self.writer.add_scalar(tag, value, step)

    def close(self, exit_code: int) -> None:
        self.writer.close()


class JsonlSink:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        # Line-buffered so a crash loses at most the line being written.
        self.file = open(path, "a", buffering=1)  # noqa: SIM115

    def write(self, step: int, floats: dict) -> None:
        # Every standard key in every record (null when not given), so readers need no .get().
        record = {"step": step, **dict.fromkeys(TB_TAGS), **floats}
        self.file.write(json.dumps(record) + "\n")

    def close(self, exit_code: int) -> None:
        self.file.close()


class WandbSink:
    """One W&B run, its files under {dump_folder}/wandb/, the resolved config attached. A run
    that resumes its own checkpoint continues the W&B run the folder's first run started (see
    job_run_id), so restarts and requeues make one set of curves."""

    def __init__(self, dump_folder: Path, rank: int | None, run_config: dict | None,
                 resuming: bool = False):  # fmt: skip
        import wandb  # optional: checks.py made sure it is installed when enabled

        dump_folder.mkdir(parents=True, exist_ok=True)
        environ = dict(os.environ)
        if "WANDB_RUN_ID" not in environ:
            environ["WANDB_RUN_ID"] = job_run_id(environ, dump_folder, resuming)
        args = wandb_run_args(environ, rank, dump_folder)
        # "allow": continue the run of that id if it exists. The user's WANDB_RESUME wins.
        resume = None if "WANDB_RESUME" in environ else "allow"
        self.run = wandb.init(dir=str(dump_folder), config=run_config, resume=resume, **args)

    def write(self, step: int, floats: dict) -> None:
        self.run.log(tagged(floats), step=step)

    def close(self, exit_code: int) -> None:
        self.run.finish(exit_code=exit_code)  # nonzero marks the run failed


def job_run_id(environ, dump_folder: Path, resuming: bool) -> str:
    """The W&B run id of this job: on a resume of the folder's own checkpoint, the id its first
    run wrote to {dump_folder}/wandb/run_id; otherwise a new one, written there. A new id is the
    same on every rank (save_for_all_ranks gives each rank `<id>-rank_N`): it is made from the
    scheduler's job id, which survives requeues (SLURM_JOB_ID and SLURM_RESTART_COUNT), or
    torchrun's run id and restart count, and the folder. A fresh start never takes an old id: W&B
    would drop every step below the old run's last."""
    saved = Path(dump_folder) / "wandb" / "run_id"
    if resuming and saved.is_file():
        return saved.read_text().strip()
    folder = hashlib.sha256(str(Path(dump_folder).resolve()).encode()).hexdigest()[:8]
    if environ.get("SLURM_JOB_ID"):
        run_id = f"slurm{environ['SLURM_JOB_ID']}-{environ.get('SLURM_RESTART_COUNT', '0')}"
    elif environ.get("TORCHELASTIC_RUN_ID", "none") != "none":  # torchrun's default rdzv id
        run_id = f"{environ['TORCHELASTIC_RUN_ID']}-{environ.get('TORCHELASTIC_RESTART_COUNT')}"
    else:
        run_id = uuid.uuid4().hex[:8]
    run_id = re.sub(r"[^A-Za-z0-9_-]", "-", f"{run_id}-{folder}")[-64:]
    saved.parent.mkdir(parents=True, exist_ok=True)
    tmp = saved.with_name(f"run_id.{os.getpid()}")
    tmp.write_text(run_id + "\n")
    tmp.replace(saved)  # every rank writes the same id; a reader never sees half a file
    return run_id


def wandb_run_args(environ, rank: int | None, dump_folder: Path) -> dict[str, str | None]:
    """wandb.init's project, entity, name, id and group from the environment, under torchtitan's
    names (WANDB_PROJECT, default "titanlite"; WANDB_TEAM, WANDB_RUN_NAME) or wandb's own
    (WANDB_ENTITY, WANDB_NAME, WANDB_RUN_ID, WANDB_RUN_GROUP). wandb reads the rest itself:
    WANDB_RESUME, WANDB_TAGS, WANDB_NOTES, WANDB_MODE.

    With a rank (save_for_all_ranks) every rank is a run of its own in one group (WANDB_RUN_GROUP,
    else the run name, else the dump folder's name: every rank derives the same one), its name
    and id ending in rank_N so each rank's folder is told apart and a resume (WANDB_RUN_ID and
    WANDB_RESUME) finds each rank's own run."""
    name = environ.get("WANDB_RUN_NAME") or environ.get("WANDB_NAME")
    run_id = environ.get("WANDB_RUN_ID")
    group = environ.get("WANDB_RUN_GROUP")
    if rank is not None:
        group = group or name or Path(dump_folder).resolve().name
        name = f"{name}-rank_{rank}" if name else f"rank_{rank}"
        run_id = f"{run_id or uuid.uuid4().hex[:8]}-rank_{rank}"
    return {
        "project": environ.get("WANDB_PROJECT", "titanlite"),
        "entity": environ.get("WANDB_TEAM") or environ.get("WANDB_ENTITY"),
        "name": name,
        "id": run_id,
        "group": group,
    }


def build_sinks(cfg, dump_folder: Path, rank: int | None, run_config: dict | None,
                resuming: bool = False) -> list:  # fmt: skip
    """The enabled sinks; `rank` (save_for_all_ranks) gives each rank its own names;
    `resuming`: the run resumes its own checkpoint (its W&B run continues)."""
    sinks: list[Sink] = []
    if cfg.enable_tensorboard:
        per_rank = "" if rank is None else f"rank_{rank}"
        sinks.append(TensorBoardSink(dump_folder / cfg.save_tb_folder / per_rank))
    if cfg.enable_jsonl:
        name = "metrics.jsonl" if rank is None else f"metrics_rank_{rank}.jsonl"
        sinks.append(JsonlSink(dump_folder / name))
    if cfg.enable_wandb:
        sinks.append(WandbSink(dump_folder, rank, run_config, resuming))
    return sinks


class SampleIdLog:
    """{dump_folder}/sample_ids.jsonl: a line per step, `{"step": k, "samples": [...]}`, the
    token cache's sample ids of the global batch the loader served for it (debug.log_sample_ids,
    written where `writes`: the log rank). A step redone after a restart gets a second line, the
    one that counts, as in metrics.jsonl."""

    def __init__(self, enabled: bool, dump_folder: str, writes: bool, loader):
        if enabled and loader.sharded:
            raise ConfigError(
                "debug.log_sample_ids needs map-style data (a token store or the token cache): "
                "a streamed source's rows are counted per dp rank, with no global sample ids"
            )
        self.loader, self.file = loader, None
        if enabled and writes:
            Path(dump_folder).mkdir(parents=True, exist_ok=True)
            # Line-buffered: a killed run keeps every step it logged.
            self.file = open(Path(dump_folder) / "sample_ids.jsonl", "a", buffering=1)  # noqa: SIM115

    def write(self, step: int) -> None:
        if self.file is not None:
            samples = self.loader.step_samples(self.loader.state_dict()["step"] - 1)
            self.file.write(json.dumps({"step": step, "samples": samples}) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
