"""Evaluate a run's checkpoints beside it, each as soon as it is published: training never waits.

    python scripts/eval_watch.py outputs/debug --tasks hellaswag,arc_easy [--limit 200] \
        [--include_path eval_tasks] [--poll 60] [--stop_after_step 10000]

The model is the run's (its config.toml: flavor, tokenizer, seq_len), in this one process on a
GPU if there is one, else the CPU; each complete step folder of {run}/{checkpoint.folder} (DCP,
full or model-only, or the HF last save) is loaded into it, resharded from whatever layout saved
it, and evaluated with lm-evaluation-harness exactly as the in-run [eval] does
(titanlite.eval.downstream). The scores go to {run}/eval_metrics.jsonl, one line per step as
{"step": N, "eval/<task>/<metric>": ..., "eval/seconds": ...}, beside the run's metrics.jsonl
and on the same step axis. Steps already in that file are skipped, so a restarted watcher goes
on where it stopped. It exits once a step >= --stop_after_step is scored (default: never).
A checkpoint pruned before it was read (checkpoint.keep_latest_k) is skipped with a warning.
"""

import argparse
import contextlib
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from titanlite.build import model_args_for  # noqa: E402
from titanlite.checkpoint import CheckpointError, CheckpointManager, LoadPlan  # noqa: E402
from titanlite.checkpoint.layout import read_marker, scan_checkpoints  # noqa: E402
from titanlite.checkpoint.storage import checkpoint_folder  # noqa: E402
from titanlite.config import Checkpoint, ConfigError, Eval  # noqa: E402
from titanlite.config_parse import parse_args  # noqa: E402
from titanlite.data.tokenizer import build_tokenizer  # noqa: E402
from titanlite.eval.downstream import DownstreamEval, load_tasks  # noqa: E402
from titanlite.metrics import init_logger  # noqa: E402
from titanlite.models import get_family  # noqa: E402

logger = logging.getLogger("titanlite.eval_watch")
OUT = "eval_metrics.jsonl"


def parse_cli(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("run", type=Path, help="the run's job.dump_folder (holds config.toml)")
    p.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated")
    p.add_argument("--include_path", default="", help="folder of lm-eval task YAML files")
    p.add_argument("--limit", type=float, default=0, help="documents per task (0 = all)")
    p.add_argument("--batch_size", type=int, default=8, help="sequences per forward")
    p.add_argument("--poll", type=float, default=60, help="seconds between looks (default 60)")
    p.add_argument("--stop_after_step", type=int, default=-1, help="exit once this step is scored")
    return p.parse_args(argv)


class Watcher:
    def __init__(self, opts):
        config = opts.run / "config.toml"
        if not config.is_file():
            raise ConfigError(f"{config} does not exist: pass the run's job.dump_folder")
        cfg = parse_args(["--job.config_file", str(config.resolve())])
        self.folder = checkpoint_folder(opts.run, cfg.checkpoint.folder)  # or an s3:// URL's
        self.out = opts.run / OUT
        tasks = [t.strip() for t in opts.tasks.split(",") if t.strip()]
        eval_cfg = Eval(tasks=tasks, limit=opts.limit, include_path=opts.include_path,
                        batch_size=opts.batch_size)  # fmt: skip
        self.evaluator = DownstreamEval(eval_cfg, None, load_tasks(eval_cfg))
        self.tokenizer = build_tokenizer(cfg.model)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        with torch.device("meta"):
            self.model = get_family(cfg.model.name).model_cls(model_args_for(cfg, self.tokenizer))
        self.model.to_empty(device=device)
        self.model.init_buffers(device)

    def done(self) -> set[int]:
        if not self.out.is_file():
            return set()
        return {json.loads(line)["step"] for line in self.out.read_text().splitlines() if line}

    def evaluate(self, step: int, path: Path) -> None:
        hf = read_marker(path).get("format") == "hf"
        manager = CheckpointManager(Checkpoint(), path.parent, self.model, None, None, None, None)
        try:
            manager.load(LoadPlan(path, weights_only=True, hf=hf))
        finally:
            manager.close()
        scores = self.evaluator.run(self.model, self.tokenizer, contextlib.nullcontext)
        with self.out.open("a") as f:
            f.write(json.dumps({"step": step, **scores}) + "\n")
        logger.info("step %d: %s", step, scores)

    def watch(self, poll: float, stop_after: int) -> None:
        done = self.done()
        while not (stop_after >= 0 and any(s >= stop_after for s in done)):
            complete, _ = scan_checkpoints(self.folder)
            for step in sorted(set(complete) - done):
                try:
                    self.evaluate(step, complete[step])
                except (CheckpointError, FileNotFoundError) as e:  # pruned meanwhile
                    logger.warning("step %d skipped: %s", step, e)
                done.add(step)
            time.sleep(poll)


def main(argv=None) -> int:
    opts = parse_cli(argv)
    init_logger(0, stream=sys.stderr)
    try:
        watcher = Watcher(opts)
    except (ConfigError, ValueError) as e:
        print(f"eval_watch: error: {e}", file=sys.stderr)
        return 2
    watcher.watch(opts.poll, opts.stop_after_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
