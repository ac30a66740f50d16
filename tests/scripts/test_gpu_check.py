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


def rehearsals(machine) -> list:
    stages = ("rehearse", "rehearse_70b", "rehearse_405b")
    return [step for name in stages for step in gc.STAGES[name][2](machine)]


@pytest.mark.parametrize("machine", [GPU, CPU_SMOKE], ids=["gpu", "cpu_smoke"])
def test_every_rehearsal_parses_as_train_py_flags(tmp_path, machine):
    """Each rehearsal row is a valid train.py command: its config (offline) or the smoke shape,
    its layout flags, the fake rank of its world."""
    rows = rehearsals(machine)
    for reh in rows:
        cfg = parse_args([*reh.train_args(machine.cpu_smoke), *reh.fake_args()])
        assert (cfg.comm.fake_world_size, cfg.comm.fake_rank) == (reh.world, reh.rank)
        assert cfg.comm.fake_steps == reh.steps and reh.rank < reh.world
    worlds = {(r.config, r.world) for r in rows}
    if machine.cpu_smoke:
        assert worlds == {("debug_model.toml", 8)}
    else:  # the shipped configs as users launch them: no file the offline machine lacks
        assert worlds == {("llama_8b.toml", 8), ("llama_70b.toml", 64), ("llama_70b.toml", 256),
                          ("llama_405b.toml", 512)}  # fmt: skip
        assert all(parse_args(r.train_args(False)).model.tokenizer_path == "" for r in rows)


def test_a_rehearsal_that_cannot_fit_is_reported_not_run(tmp_path):
    """The estimate exceeds the GPU: SKIP with both figures, and train.py never launched."""
    launched = []

    def launch(cmd, log, timeout_s):
        launched.append(cmd)
        log.write_text("total (estimated peak per rank)   95.5\n")
        return 0

    reh = gc.STAGES["rehearse"][2](GPU)[0]
    row = gc.execute_rehearsal(reh, tmp_path, GPU, 60, launch)
    assert row["result"] == "SKIP" and "cannot fit: estimate 95.5 GiB > 79.2 GiB" in row["why"]
    assert len(launched) == 1 and launched[0][1].endswith("estimate_memory.py")


@pytest.mark.slow
def test_cpu_smoke_rehearses_a_rank_end_to_end(tmp_path):
    """The rehearse stage tiny and on a CPU: the estimate, the rehearsal, its row and table."""
    out = tmp_path / "out"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHON=PYTHON)
    cmd = [str(REPO / "scripts" / "gpu_check.sh"), "--cpu-smoke", "--out", str(out), "rehearse"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = gc.read_jsonl(out / "results.jsonl")
    assert row["name"] == "r_debug_fsdp8" and row["result"] == "PASS", row
    assert row["steps"] == 2 and row["wps"] > 0 and row["reserved_gib"] > 0.1
    assert row["estimate_gib"] > 0 and "rank 3 of 8" in row["why"]
    assert "planner" in row["why"] and "with communication on h100-sxm" in row["why"]
    assert "| PASS (rank 3 of 8" in (out / "table.md").read_text()


def test_a_rehearsed_ranks_estimate_is_its_pipeline_ranks_column():
    from gpu_check_rehearse import parse_rank_estimate

    pp = "total (estimated peak per rank)      72.337   69.076   53.347\n"
    assert [parse_rank_estimate(pp, r, 12) for r in (0, 3, 4, 11)] == [72.337, 72.337, 69.076,
                                                                       53.347]  # fmt: skip
    flat = "context / NCCL / slack   2.5\ntotal (estimated peak per rank)   44.5\n"
    assert parse_rank_estimate(flat, 5, 8) == 42.0
    assert parse_rank_estimate("nothing", 0, 8) is None
