"""scripts/eval_watch.py beside a running training job: it scores each checkpoint as it is
published, on the run's step axis, with the scores the run itself measured at those steps."""

import subprocess
import sys
import time

import pytest
from conftest import REPO, TINY_TRAIN, read_jsonl
from script_runner import run_script

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow  # runs train.py beside the watcher

SCRIPT = REPO / "scripts" / "eval_watch.py"
EVAL = ["--eval.tasks", "tl_mc,tl_gen", "--eval.limit", "4"]


def test_the_watcher_scores_two_checkpoints_of_a_running_job(tmp_path, task_folder):
    tasks = task_folder(tmp_path / "tasks")
    run = tmp_path / "run"
    train = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *TINY_TRAIN, "--training.steps", "6",
         "--checkpoint.enable", "--checkpoint.interval", "3", *EVAL, "--eval.freq", "3",
         "--eval.include_path", str(tasks), "--job.dump_folder", str(run)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    while not (run / "config.toml").is_file() and train.poll() is None:  # the run has started
        time.sleep(0.2)
    watch = subprocess.run(
        [sys.executable, str(SCRIPT), str(run), "--tasks", "tl_mc,tl_gen", "--limit", "4",
         "--include_path", str(tasks), "--poll", "0.5", "--stop_after_step", "6"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    _, err = train.communicate(timeout=900)
    assert train.returncode == 0, err[-3000:]
    assert watch.returncode == 0, watch.stderr[-3000:]
    scored = read_jsonl(run / "eval_metrics.jsonl")
    assert [row["step"] for row in scored] == [3, 6]
    in_run = {
        row["step"]: row for row in read_jsonl(run / "metrics.jsonl") if "eval/seconds" in row
    }
    for row in scored:
        for name in ("eval/tl_mc/acc", "eval/tl_mc/acc_norm", "eval/tl_gen/exact_match"):
            assert row[name] == in_run[row["step"]][name], (row["step"], name)


def test_a_folder_without_a_run_is_one_line(tmp_path):
    proc = run_script(SCRIPT, str(tmp_path), "--tasks", "tl_mc")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"eval_watch: error: {tmp_path / 'config.toml'} does not exist: pass the run's "
        "job.dump_folder"
    )
