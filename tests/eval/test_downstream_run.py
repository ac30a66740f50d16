"""[eval] inside training runs (one process, FSDP 2, TP 2): at eval.freq and the last step the
scores land in metrics.jsonl as eval/<task>/<metric>, and the last step's equal lm-eval's own `hf`
model on the run's HF export of the same weights; bad task input stops the run with one line."""

import pytest
from conftest import TINY_TRAIN, read_jsonl, train_many

import train

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.evaluator import simple_evaluate  # noqa: E402

pytestmark = pytest.mark.slow  # every test here runs train.py

TASKS = ["tl_mc", "tl_gen"]
LIMIT = 5


def run_args(dump, tasks) -> list[str]:
    return [
        *TINY_TRAIN, "--training.steps", "2", "--checkpoint.enable",
        "--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf",
        "--eval.tasks", ",".join(TASKS), "--eval.include_path", str(tasks), "--eval.freq", "1",
        "--eval.limit", str(LIMIT), "--eval.batch_size", "3", "--job.dump_folder", str(dump),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, task_folder):
    return task_folder(tmp_path_factory.mktemp("run_tasks") / "tasks")


def hf_scores(export, tasks) -> dict:
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model="hf", model_args={"pretrained": str(export), "dtype": "float32"}, tasks=TASKS,
        limit=LIMIT, task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        bootstrap_iters=0, batch_size=1, device="cpu", verbosity="WARNING",
    )["results"]  # fmt: skip
    return {f"eval/{t}/{k.split(',')[0]}": v for t, r in results.items() for k, v in r.items()
            if k.endswith(",none") and "_stderr" not in k}  # fmt: skip


@pytest.mark.parametrize("layout", ["one", "fsdp2", "tp2"])
def test_in_run_scores_equal_lm_evals_on_the_export(tmp_path, tasks, layout):
    dump = tmp_path / "run"
    args = run_args(dump, tasks)
    if layout == "one":
        assert train.main(args) == 0
    else:
        tp = ["--parallelism.tensor_parallel_degree", "2"] if layout == "tp2" else []
        train_many([[*args, *tp]], nproc=2)
    rows = [r for r in read_jsonl(dump / "metrics.jsonl") if "eval/seconds" in r]
    assert [r["step"] for r in rows] == [1, 2]
    want = hf_scores(dump / "checkpoint" / "step-2", tasks)
    assert set(want) == {"eval/tl_mc/acc", "eval/tl_mc/acc_norm", "eval/tl_gen/exact_match"}
    for name, value in want.items():
        assert rows[-1][name] == pytest.approx(value, abs=1e-9), name


def test_bad_task_input_stops_the_run_with_one_line(tmp_path, tasks, capsys):
    (tasks / "broken.yaml").write_text("task: x\n  y: [\n")
    try:
        argv = run_args(tmp_path / "run", tasks)
        assert train.main(argv) == 2
    finally:
        (tasks / "broken.yaml").unlink()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("titanlite: error:")]
    assert len(lines) == 1 and "broken.yaml is not valid YAML (line 2)" in lines[0], err[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
