"""scripts/gpu_check.py on a CPU: its stages' flags against train.py's parser, what skips, the
layer-count flavors, the no-GPU exit, and (slow) the estimate and the debug stage end to end
through scripts/gpu_check.sh --cpu-smoke. Its pass rules and table: test_gpu_check_report.py."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from titanlite.config_parse import parse_args


def load_gpu_check():
    path = REPO / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gc = load_gpu_check()
GPU = gc.Machine(ngpu=1, device="1x NVIDIA H100 80GB HBM3", torch="2.11.0+cu130",
                 memory_gib=79.2, float8=True)  # fmt: skip
# The script runs $PYTHON (default python3): this interpreter, as an unactivated venv has it.
PYTHON = sys.executable
CPU_SMOKE = gc.Machine(0, "cpu", "2.13.0+cpu", 0.0, float8=False, cpu_smoke=True)


def test_every_stage_parses_as_train_py_flags(tmp_path):
    """Every train.py run of every stage (8 GPUs: all stages) is a valid train.py command."""
    machine = gc.Machine(8, "8x H100", "2.11.0", 79.2, float8=True)
    names = []
    for stage in gc.stages_for(8):
        for step in gc.STAGES[stage][2](machine):
            names.append(step.name)
            if isinstance(step, gc.Run) and step.script == "train.py":
                cfg = parse_args(gc.train_args(step, tmp_path, machine))
                assert cfg.job.dump_folder == str(tmp_path)
    assert len(names) == len(set(names)), "run names must be unique: they name the folders"
    assert (
        gc.stages_for(0) == gc.stages_for(1) == [s for s in gc.STAGES if s not in {"multi", "8b"}]
    )
    assert gc.stages_for(2)[-1] == "multi" and gc.stages_for(8)[-1] == "8b"
    # Three GPUs: the degree-2 runs use two of them.
    assert {r.nproc for r in gc.multi_stage(gc.Machine(3, "", "", 79.2, True))} == {2}


def test_cpu_smoke_flags_come_last(tmp_path):
    run = gc.Run("x", ("--training.steps", "50", "--training.seq_len", "8192"))
    cfg = parse_args(gc.train_args(run, tmp_path, CPU_SMOKE))
    assert (cfg.training.steps, cfg.training.seq_len) == (3, 32)


def test_runs_that_cannot_run_here_skip(tmp_path):
    no_f8 = gc.Machine(1, "1x A100", "2.11.0", 79.2, float8=False)
    row = gc.execute(gc.Run("f8", (), float8=True), tmp_path, no_f8, timeout_s=1)
    assert row["result"] == "SKIP" and "float8" in row["why"]
    assert gc.skip_reason(gc.Run("tp", (), nproc=2), GPU) == "needs 2 GPUs"
    assert gc.skip_reason(gc.Run("plain", ()), GPU) == ""


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(capsys, tmp_path):
    cpu = {"torch": "2.13.0+cpu", "ngpu": 0, "device": "cpu", "memory_gib": 0.0, "sm": [0, 0],
           "torchao": False}  # fmt: skip
    assert gc.main(["--out", str(tmp_path / "out")], probe=lambda: cpu) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no CUDA GPU" in out
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_shell_script_without_a_gpu(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", GPU_CHECK_WHEELS=str(tmp_path), PYTHON=PYTHON)
    proc = subprocess.run([str(REPO / "scripts" / "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1 and "no CUDA GPU" in proc.stdout


@pytest.mark.slow
def test_cpu_smoke_runs_the_debug_stage_end_to_end(tmp_path):
    """The debug stage's four train.py runs (one under torchrun) and its bitwise comparison,
    tiny and on a CPU: the commands, the result rows and the table all work."""
    out = tmp_path / "out"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHON=PYTHON)
    cmd = [str(REPO / "scripts" / "gpu_check.sh"), "--cpu-smoke", "--out", str(out), "debug"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = gc.read_jsonl(out / "results.jsonl")
    assert [r["name"] for r in rows] == ["debug", "debug_torchrun", "det_a", "det_b", "det_a=det_b"]
    assert all(r["result"] == "PASS" for r in rows), rows
    assert rows[0]["steps"] == 3 and rows[0]["loss_last"] < rows[0]["loss_first"]
    table = (out / "table.md").read_text()
    assert table in proc.stdout and table.count("| PASS") == 5
    assert json.loads((out / "runs" / "det_a" / "metrics.jsonl").read_text().splitlines()[0])


@pytest.mark.slow
def test_estimate_runs_estimate_memory_with_the_runs_flags(tmp_path):
    """A layer-count flavor there too: 8B_4L, 4 layers of 8B's shape, against 8B_8L (the tiny
    CPU-smoke vocabulary and sequence, on the CPU)."""
    four, eight = (
        gc.estimate(gc.Run(n, ("--model.flavor", n), estimate=True), tmp_path, CPU_SMOKE, 300)
        for n in ("8B_4L", "8B_8L")
    )
    assert 0 < four < eight
