"""python -m titanlite.plan as a user runs it: the table, JSON, the written config, --predict,
--calibrate, bad input as one line, and the dry runs' progress on a terminal."""

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import Terminal

import titanlite.plan.__main__ as plan_main
import train
from titanlite.config_parse import parse_args
from titanlite.job import World, resolve_job
from titanlite.plan.__main__ import checked, main
from titanlite.plan.search import Plan
from titanlite.plan.shape import layout_of
from titanlite.progress import Progress

DEBUG = ["--job.config_file", "debug_model.toml", "--training.seq_len", "2048", "--no_float8"]
H200_RUNS = Path(__file__).parent / "data" / "h200"


def plan(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_write_gives_a_config_that_the_dry_run_builds_at_its_world_size(capsys, tmp_path):
    best = tmp_path / "best.toml"
    rc, out, _ = plan(capsys, *DEBUG, "--gpus", "8", "--write", str(best), "--top", "3")
    assert rc == 0, out
    assert "checked by the dry run at world 8: the best 1" in out and f"wrote {best}" in out
    first = out.splitlines()[4]  # the header's 3 lines, the column names, then row 1
    job = resolve_job(parse_args(["--job.config_file", str(best)]), World(8))
    layout = layout_of(job)
    assert first.split()[1] == layout.describe().split()[0]
    dry_run = ["--comm.mode", "fake_backend", "--comm.fake_world_size", "8"]
    argv = ["--job.config_file", str(best), *dry_run, "--job.dump_folder", str(tmp_path)]
    assert train.main(argv) == 0
    assert json.loads((tmp_path / "dry_run.json").read_text())["world_size"] == 8


def test_json_rows_carry_flags_speed_memory_and_the_time_split(capsys):
    rc, out, _ = plan(capsys, *DEBUG, "--gpus", "4", "--json", "--top", "5", "--check", "0")
    rows = json.loads(out)
    assert rc == 0 and len(rows) == 5
    for row in rows:
        assert {"flags", "tokens_per_s_per_gpu", "mfu", "peak_memory_gib", "split_s"} <= set(row)
        assert "--parallelism.tensor_parallel_degree" in row["flags"]
        assert sum(row["split_s"].values()) == pytest.approx(row["step_s"], rel=1e-3)
    speeds = [r["tokens_per_s_per_gpu"] for r in rows]
    assert speeds == sorted(speeds, reverse=True)


def test_predict_and_explain_show_the_configs_own_layout(capsys):
    rc, out, _ = plan(capsys, "--job.config_file", "llama_8b.toml", "--gpus", "8", "--predict",
                      "--parallelism.tensor_parallel_degree", "2")  # fmt: skip
    assert rc == 0 and "tp 2 x fsdp 4" in out
    assert "train.py flags:" in out and "step = compute" in out and "block_tp_s" in out


def test_calibrated_constants_are_used_by_the_next_plan(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TITANLITE_PLAN_DIR", str(tmp_path))
    runs = [str(p) for p in sorted(H200_RUNS.glob("cal_1B*"))]
    rc, out, _ = plan(capsys, "--device", "h200", "--vocab_size", "100352", "--calibrate", *runs)
    assert rc == 0 and f"saved to {tmp_path / 'h200.json'}" in out
    assert out.count("%") == 3 * len(runs)  # error columns per run: tokens/s, reserved, active
    rc, out, _ = plan(capsys, *DEBUG, "--gpus", "2", "--device", "h200", "--check", "0")
    assert rc == 0 and f"constants: fitted on {len(runs)} runs" in out


@pytest.mark.parametrize("argv, message", [
    (["--device", "h100"], "unknown device 'h100'; known: h100-sxm"),
    (["--gpus", "0"], "--gpus and --gpus_per_node must be >= 1"),
    (["--global_batch_tokens", "1000"], "is not a multiple of training.seq_len 2048"),
    (["--explain", "100000", "--check", "0"], "--explain 100000: rows are 1.."),
    (["--training.seq_lenn", "8"], "did you mean --training.seq_len"),
    # The config's own layout on --gpus is resolved as train.py would (titanlite/job.py).
    (["--predict", "--gpus", "3", "--parallelism.tensor_parallel_degree", "3"],
     "must divide both n_heads (16)"),
])  # fmt: skip
def test_bad_input_is_one_line(capsys, argv, message):
    rc, _, err = plan(capsys, *DEBUG, *argv)
    assert rc == 2 and message in err and err.count("\n") == 1


def test_a_gpu_count_no_layout_divides_names_the_smallest_cluster(capsys):
    rc, _, err = plan(capsys, *DEBUG, "--gpus", "3", "--global_batch_tokens", "4096")
    assert rc == 2 and "global batch not divisible by the data-parallel degree" in err
    assert "too few microbatches for the schedule" in err  # pp 3 with 2 sequences
    assert "the smallest cluster where one does: 1 GPU" in err


def test_a_model_that_fits_nowhere_names_the_smallest_cluster(capsys):
    rc, _, err = plan(capsys, "--job.config_file", "llama_405b.toml", "--gpus", "16")
    assert rc == 2 and "no layout of 405B with global batch 4 fits 16 x h100-sxm" in err
    assert "out of memory" in err and "the smallest cluster where one does: 128 GPUs" in err


def test_compare_prints_measured_beside_predicted_without_fitting(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TITANLITE_PLAN_DIR", str(tmp_path))
    runs = sorted(str(p) for p in H200_RUNS.glob("b_*"))
    rc, out, _ = plan(capsys, "--device", "h200", "--vocab_size", "100352", "--compare", *runs)
    rows = [line.split() for line in out.splitlines() if "b_" in line]
    assert rc == 0 and len(rows) == len(runs) == 5
    # tokens/s, peak reserved and peak active GiB, each measured, predicted and the error
    assert all(len(row) == 10 and all(row[i].endswith("%") for i in (3, 6, 9)) for row in rows)
    eager = next(row for row in rows if "b_1B_8k_full_eager" in row[0])
    assert eager[7] == "23.8"  # the run's memory_active_gib, 23.75, to 0.1 GiB
    assert float(eager[8]) < float(eager[5])  # the live estimate leaves out the allocator's cache
    assert "b_8B6L_4k_b2_sac" in out and not list(tmp_path.iterdir())  # nothing saved


def test_dry_run_progress_counts_layouts_one_more_for_each_dropped(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(plan_main, "Progress",
                        functools.partial(Progress, stream=terminal, every_s=0))  # fmt: skip
    verdicts = iter(["rank 0: does not build", "", ""])  # the best layout is dropped
    monkeypatch.setattr(plan_main, "dry_run", lambda argv, c: next(verdicts))
    fits = [SimpleNamespace(layout=SimpleNamespace(world=8)) for _ in range(4)]
    dropped, note = checked(Plan(fits=list(fits)), [], 2)
    assert len(dropped) == 1 and note == "checked by the dry run at world 8: the best 2"
    lines = terminal.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "plan: dry runs: 1 of 3 layouts (33%)",
        "plan: dry runs: 2 of 3 layouts (67%)",
        "plan: dry runs: 3 of 3 layouts (100%)",
    ]


@pytest.mark.parametrize("asked", [[], ["--float8"]])
def test_write_keeps_float8_off_unless_asked(capsys, tmp_path, asked):
    """float8 changes the numerics: --write turns it on only with --float8 (on H100s it is the
    faster choice for the 8B, so the search would pick it)."""
    from titanlite.float8 import float8_enabled

    best = tmp_path / "best.toml"
    argv = ["--job.config_file", "llama_8b.toml", "--gpus", "8", "--check", "0", "--top", "1"]
    rc, out, _ = plan(capsys, *argv, *asked, "--write", str(best))
    assert rc == 0, out
    assert float8_enabled(parse_args(["--job.config_file", str(best)])) == bool(asked)
    assert (" f8 " in out.splitlines()[4]) == bool(asked)  # row 1, the one written
