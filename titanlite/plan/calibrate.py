"""Fit the step-time model's constants to real runs, and keep them where later plans read them.

A run folder is what train.py leaves in job.dump_folder: config.toml and metrics.jsonl. The
measured figure is the median per-device tokens/s over the logged steps after the first three
(compile and warm-up); the world size and vocab come from the first logged step, where every
run writes them with its predictions (runs from before then: world 1, --vocab_size). The fit
minimizes the squared log error of the predicted step times, with a weak pull towards the
defaults so that a constant the runs say nothing about (no float8 run: its speedup) stays.
"""

import json
import math
import os
import statistics
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from titanlite.config import ConfigError
from titanlite.config_parse import parse_args
from titanlite.job import World, resolve_job
from titanlite.plan.devices import Device
from titanlite.plan.perf import Constants, Layout, predict
from titanlite.plan.shape import Model, layout_of, model_of

PRIOR_WEIGHT = 0.01  # per constant, against a squared log error per run
SKIPPED_STEPS = 3


@dataclass
class Run:
    folder: str
    model: Model
    layout: Layout
    tokens_per_s: float  # per device, measured
    memory_gib: float | None  # peak reserved, measured
    gpus_per_node: int = 8
    active_gib: float | None = None  # peak in use (CUDA's active memory), measured


def read_run(folder: str | Path, vocab_size: int | None = None) -> Run:
    """A finished run's config, layout and measured throughput (ConfigError if unusable)."""
    folder = Path(folder)
    config, metrics = folder / "config.toml", folder / "metrics.jsonl"
    for f in (config, metrics):
        if not f.is_file():
            raise ConfigError(f"{folder}: no {f.name}; give run folders that train.py wrote")
    cfg = parse_args(["--job.config_file", str(config)])
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    # A resumed run appends to the same file: its own records start at its last plan record.
    starts = [i for i, r in enumerate(records) if r.get("world_size")]
    plan = records[starts[-1]] if starts else None
    steps = [r for r in records[starts[-1] if starts else 0 :] if r.get("wps") is not None]
    if len(steps) <= SKIPPED_STEPS:
        raise ConfigError(f"{folder}: {len(steps)} logged steps; calibration needs more than "
                          f"{SKIPPED_STEPS} (the first ones compile and warm up)")  # fmt: skip
    world = int(plan["world_size"]) if plan else 1
    vocab = int(plan["vocab_size"]) if plan else vocab_size
    if vocab is None:
        raise ConfigError(f"{folder}: no plan record in metrics.jsonl; pass --vocab_size")
    tps = statistics.median(r["wps"] for r in steps[SKIPPED_STEPS:])
    mem, active = (
        max((r[k] for r in steps if r.get(k) is not None), default=None)
        for k in ("memory_gib", "memory_active_gib")
    )
    layout = layout_of(resolve_job(cfg, World(world), vocab))
    return Run(str(folder), model_of(cfg, vocab), layout, tps, mem, active_gib=active)


def predicted_tps(run: Run, device: Device, c: Constants) -> float:
    return predict(run.model.shape, run.layout, device, run.gpus_per_node, c).tokens_per_s_per_gpu


FITTED = ("matmul_efficiency", "attention_efficiency", "elementwise_passes",
          "eager_elementwise_passes", "comm_efficiency", "float8_matmul_speedup")  # fmt: skip


def fit(runs: list[Run], device: Device, start: Constants | None = None) -> Constants:
    """Constants that make the model's tokens/s match the runs' (coordinate search in log
    space), starting from `start` (the defaults)."""
    start = start or Constants()

    def loss(c: Constants) -> float:
        err = sum(math.log(predicted_tps(r, device, c) / r.tokens_per_s) ** 2 for r in runs)
        prior = sum(math.log(getattr(c, n) / getattr(start, n)) ** 2 for n in FITTED)
        return err + PRIOR_WEIGHT * prior

    best, best_loss, step = start, loss(start), 0.5
    while step > 1e-3:
        improved = False
        for name in FITTED:
            for factor in (1 + step, 1 / (1 + step)):
                value = getattr(best, name) * factor
                if name.endswith("efficiency") and value > 1:
                    continue
                trial = replace(best, **{name: value})
                trial_loss = loss(trial)
                if trial_loss < best_loss:
                    best, best_loss, improved = trial, trial_loss, True
        if not improved:
            step /= 2
    return replace(best, source=f"fitted on {len(runs)} runs")


def calibration_path(device_name: str) -> Path:
    """Where plans look for a device's fitted constants."""
    root = os.environ.get("TITANLITE_PLAN_DIR") or Path.home() / ".cache" / "titanlite" / "plan"
    return Path(root) / f"{device_name}.json"


def save(constants: Constants, device_name: str, runs: list[Run], path: Path | None = None) -> Path:
    path = path or calibration_path(device_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"device": device_name, "constants": asdict(constants),
              "runs": [r.folder for r in runs]}  # fmt: skip
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def load(device_name: str, path: Path | None = None) -> Constants:
    """The device's fitted constants, or the defaults where none were fitted."""
    path = path or calibration_path(device_name)
    if not path.is_file():
        return Constants()
    try:
        values = json.loads(path.read_text())["constants"]
        known = {f.name for f in fields(Constants)}
        return Constants(**{k: v for k, v in values.items() if k in known})
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a calibration file ({e}); delete it or recalibrate") from e
