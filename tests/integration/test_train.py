"""train.py end to end, as a user runs it: real processes, the embedded data, the debug model."""

import pytest
import tomllib
import torch
from conftest import TINY_TRAIN, read_jsonl
from wandb_offline import read_offline_run

import train
from titanlite.metrics_sinks import tagged

pytestmark = pytest.mark.slow  # every test here launches processes

# Small and fast: the debug shape with a short sequence, fp32 so numbers are comparable.
FAST = [
    "--job.config_file", "debug_model.toml",
    "--training.seq_len", "64",
    "--training.local_batch_size", "4",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "2",
]  # fmt: skip


def test_debug_run_learns_and_reports_every_metric(tmp_path, train_runner):
    out = tmp_path / "run"
    proc = train_runner(
        [*FAST, "--training.steps", "30", "--metrics.log_freq", "5", "--job.dump_folder", str(out)]
    )
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 5, 10, 15, 20, 25, 30]
    keys = {"step", "loss", "grad_norm", "lr", "wps", "tflops", "mfu", "memory_gib"}
    keys |= {"data_time_pct", "elapsed_s", "tokens_seen"}
    for r in rows:
        assert keys <= r.keys()
        assert r["wps"] > 0 and r["mfu"] > 0 and r["memory_gib"] > 0
        assert r["tokens_seen"] == r["step"] * 4 * 64  # one process: local batch x seq_len
    # ln(2048) = 7.6 at init; the falling loss shows the whole pipeline learns.
    assert rows[0]["loss"] > 7.0
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    # The LR each logged step used: half the peak at step 1 of a 2-step warmup.
    resolved = tomllib.loads((out / "config.toml").read_text())
    assert rows[0]["lr"] == pytest.approx(resolved["optimizer"]["lr"] / 2)
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert resolved["training"]["steps"] == 30
    assert "mfu" in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--training.stpes", "3"], "did you mean --training.steps"),
        (["--training.steps", "ten"], "int"),
        (["--job.config_file", "no_such.toml"], "no_such.toml"),
        (["--training.global_batch_size", "6"], "multiple"),
        (["--parallelism.tensor_parallel_degree", "3"], "world size"),
        (
            ["--training.dataset", "local", "--training.dataset_path", "/no/such/*.jsonl"],
            "/no/such",
        ),
        (["--model.flavor", "9B"], "debugmodel"),
        (["--model.name", "foo"], "registered: llama3"),
        (["--checkpoint.enable", "--checkpoint.load_step", "7"], "no complete checkpoint"),
        (["--checkpoint.initial_load_path", "/no/such/step-0"], "/no/such/step-0"),
        (["--model.attention_backend", "flex"], "flex only applies document masks"),
        (["--parallelism.pipeline_parallel_schedule", "1f1c"], "'1f1c' is not a known schedule"),
        # Folders that cannot be made (a path under a file): named before any work.
        (["--job.dump_folder", "/dev/null/out"], "job.dump_folder /dev/null/out cannot be created"),
        (["--checkpoint.enable", "--checkpoint.folder", "/dev/null/ck"], "checkpoint.folder /dev"),
        (["--training.data_cache_dir", "/dev/null/c"], "the token cache (training.data_cache_dir"),
        pytest.param(
            ["--model.flavor", "debugmodel_flex_attn", "--model.attention_backend", "flex"],
            "cannot train on CPU",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only refusal"),
        ),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, capsys, args, expected):
    """train.main in this process: `python train.py` exits with its return value (real processes
    exit 2 in test_missing_load_step_fails_before_the_model_is_built and under torchrun in
    test_parallel_numerics.py)."""
    assert train.main([*FAST, "--job.dump_folder", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert "Traceback" not in err


PP2 = ["--parallelism.pipeline_parallel_degree", "2"]


@pytest.mark.parametrize("nproc, layout", [(1, []), (2, PP2)], ids=["one", "pp2"])
def test_nonfinite_loss_stops_with_the_step_named(tmp_path, train_runner, nproc, layout):
    """An absurd learning rate blows the weights up after the first update. Under PP the norm
    is summed over the stages, so both ranks see it and stop at the same step (no hang)."""
    args = [*TINY_TRAIN, "--job.dump_folder", str(tmp_path), "--training.steps", "5", *layout]
    proc = train_runner([*args, "--optimizer.lr", "1e30"], nproc=nproc, check=False)
    assert proc.returncode != 0
    out = proc.stderr + proc.stdout
    assert "non-finite values at step" in out
    # NonFiniteError's exit code, not a crash or a timeout (torchrun reports the first child).
    assert proc.returncode == 3 if nproc == 1 else "exitcode  : 3" in proc.stderr, out


def test_nonfinite_steps_can_be_skipped(tmp_path, capsys):
    args = [*TINY_TRAIN, "--job.dump_folder", str(tmp_path), "--training.steps", "4"]
    assert train.main([*args, "--optimizer.lr", "1e30", "--training.on_nonfinite", "skip"]) == 0
    out = capsys.readouterr()
    assert "skipped" in out.err + out.out


def test_wandb_run_holds_what_metrics_jsonl_holds(tmp_path, wandb_offline):
    """train.main with W&B on (offline): every logged step's values, validation's too, the
    resolved config and the exit code, as the trainer wires the sink."""
    args = [*TINY_TRAIN, "--job.dump_folder", str(tmp_path), "--training.steps", "3"]
    args += ["--metrics.enable_wandb", "--validation.enable", "--validation.freq", "2"]
    assert train.main([*args, "--validation.steps", "1"]) == 0
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    run = read_offline_run(run_dir)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert run.history == {row.pop("step"): tagged(row) for row in rows}
    assert sorted(run.history) == [1, 2, 3] and "loss/validation" in run.history[2]
    assert run.config["training"]["steps"] == 3 and run.config["metrics"]["enable_wandb"]
    assert run.exit_code == 0


def test_validation_runs_at_its_own_frequency_not_only_on_log_steps(tmp_path):
    args = [*TINY_TRAIN, "--job.dump_folder", str(tmp_path), "--training.global_batch_size", "2"]
    args += ["--training.steps", "100", "--metrics.log_freq", "10"]
    assert train.main([*args, "--validation.enable", "--validation.freq", "25",
                       "--validation.steps", "1"]) == 0  # fmt: skip
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if r.get("val_loss") is not None] == [25, 50, 75, 100]
    assert [r["step"] for r in rows if r["loss"] is not None] == [1, *range(10, 101, 10)]


def test_missing_load_step_fails_before_the_model_is_built(tmp_path, train_runner):
    # A 1B model would take a while to build and initialize: the error must come first.
    (tmp_path / "checkpoint" / "step-5").mkdir(parents=True)
    (tmp_path / "checkpoint" / "step-5" / "COMPLETE").touch()
    args = ["--model.flavor", "1B", "--checkpoint.enable", "--checkpoint.load_step", "999"]
    proc = train_runner([*args, "--job.dump_folder", str(tmp_path)], check=False)
    assert proc.returncode == 2, proc.stderr
    assert "load_step=999" in proc.stderr and "[5]" in proc.stderr
    assert "tokeniz" not in proc.stdout and "parameters" not in proc.stdout
