"""[eval]: lm-evaluation-harness tasks on the training model where it stands, in the run.

lm-eval supplies the tasks (its registry: hub tasks, and local task YAMLs from
eval.include_path), prompts and metrics; titanlite.eval.harness the model. Scores are logged as
eval/<task>/<metric> (a filter other than "none" is appended: exact_match_strict-match), with
eval/seconds, the time it took, which is not a training step's and so not in the throughput.

The tasks are loaded when the run starts, before anything is built: an unknown task, a task file
that is not YAML or that lm-eval refuses (its message), a missing include_path each stop the run
with one line. lm-eval's own seeding is off (it would reseed the training's RNGs); its few-shot
sampler keeps its fixed seed.
"""

import contextlib
import logging
import os
import time
from pathlib import Path

import yaml

from titanlite.config import ConfigError

logger = logging.getLogger(__name__)


class _AnyTagLoader(yaml.SafeLoader):
    """Parses lm-eval's YAML (its `!function` tags) only to tell whether it is YAML at all."""


_AnyTagLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def _check_yaml_files(folder: Path) -> None:
    for path in sorted(folder.rglob("*.yaml")):
        try:
            yaml.load(path.read_text(), Loader=_AnyTagLoader)  # noqa: S506 (a safe loader)
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            at = f" (line {where.line + 1})" if where is not None else ""
            raise ConfigError(
                f"eval.include_path: {path} is not valid YAML{at}: fix or remove it"
            ) from e


def load_tasks(cfg):
    """The TaskManager for eval.tasks, whose tasks were loaded once here (the check)."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise ConfigError(
            "eval.tasks needs lm-evaluation-harness: pip install titanlite[eval]"
        ) from e
    include = Path(cfg.include_path).expanduser() if cfg.include_path else None
    if include is not None:
        if not include.is_dir():
            raise ConfigError(f"eval.include_path {include} is not a folder of task YAML files")
        _check_yaml_files(include)
    # lm-eval's own thousands of tasks take minutes to index: only when a task is not local.
    manager = None
    if include is not None:
        manager = TaskManager(include_path=str(include), include_defaults=False)
    if manager is None or not set(cfg.tasks) <= set(manager.all_tasks):
        manager = TaskManager(include_path=str(include) if include else None)
    unknown = [t for t in cfg.tasks if t not in manager.all_tasks]
    if unknown:
        where = f" nor in eval.include_path {include}" if include else ""
        raise ConfigError(
            f"eval.tasks: unknown task {unknown[0]!r} (not in lm-eval's registry{where})"
        )
    try:
        manager.load(list(cfg.tasks))
    except Exception as e:  # lm-eval raises what it meets: ValueError, KeyError, OSError, ...
        raise ConfigError(f"eval.tasks: lm-eval cannot load {cfg.tasks}: {e}") from e
    return manager


def scores(results: dict) -> dict[str, float]:
    """lm-eval's {task: {"acc,none": v, "acc_stderr,none": s, "alias": ...}} -> metrics."""
    out = {}
    for task, values in results.items():
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            if metric.endswith("_stderr") or not isinstance(value, int | float) or not filt:
                continue
            name = metric if filt == "none" else f"{metric}_{filt}"
            out[f"eval/{task}/{name}"] = float(value)
    return out


@contextlib.contextmanager
def _results_on_every_rank():
    """lm-eval returns its results only where LOCAL_RANK is 0 (it takes the others for TP
    ranks): every rank computed them alike here, and the metrics logger's rank needs them."""
    local_rank = os.environ.pop("LOCAL_RANK", None)
    try:
        yield
    finally:
        if local_rank is not None:
            os.environ["LOCAL_RANK"] = local_rank


class DownstreamEval:
    """Runs when its `schedule` is due (eval.freq and the last step, when eval.tasks is set)."""

    def __init__(self, cfg, schedule, manager):
        self.cfg, self.schedule, self.manager = cfg, schedule, manager

    def due(self, step: int) -> bool:
        return self.schedule.due(step)

    def run(self, model, tokenizer, model_context) -> dict[str, float]:
        from lm_eval.evaluator import simple_evaluate

        from titanlite.eval.harness import TitanliteLM

        t0 = time.perf_counter()
        limit = self.cfg.limit
        limit = None if limit == 0 else int(limit) if limit >= 1 else limit
        model.eval()
        try:
            with _results_on_every_rank():
                results = simple_evaluate(
                    model=TitanliteLM(model, tokenizer, self.cfg.batch_size, model_context),
                    tasks=list(self.cfg.tasks), limit=limit, task_manager=self.manager,
                    bootstrap_iters=0, log_samples=False, random_seed=None,
                    numpy_random_seed=None, torch_random_seed=None, verbosity="WARNING",
                )  # fmt: skip
        finally:
            model.train()
            if hasattr(model, "reshard"):  # FSDP's root stays unsharded after a no-grad forward
                model.reshard()
        metrics = scores(results["results"])
        metrics["eval/seconds"] = time.perf_counter() - t0
        logger.info("downstream evaluation: %s", metrics)
        return metrics


def build_downstream(cfg, pipeline, schedule) -> DownstreamEval:
    """From the JobConfig `cfg`; `pipeline`: the job's pipeline plan (None without PP);
    `schedule`: when it is due (never without eval.tasks)."""
    if not cfg.eval.tasks:
        return DownstreamEval(cfg.eval, schedule, None)
    if pipeline is not None:
        raise ConfigError(
            "eval.tasks is not supported with pipeline parallelism yet (no stage holds the whole "
            "model): evaluate the checkpoints beside the run (docs/evaluation.md)"
        )
    return DownstreamEval(cfg.eval, schedule, load_tasks(cfg.eval))
