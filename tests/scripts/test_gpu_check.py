"""scripts/gpu_check.py on a CPU: its pass rules and table from synthetic metrics.jsonl files
written by the real MetricsLogger, its stages' flags against train.py's parser, the no-GPU exit,
and (slow) the debug stage end to end through scripts/gpu_check.sh --cpu-smoke."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from titanlite.config import Metrics
from titanlite.config_parse import parse_args
from titanlite.metrics import MetricsLogger
from titanlite.models.llama import args as llama_args


def load_gpu_check():
    path = REPO / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gc = load_gpu_check()
GPU = gc.Machine(ngpu=1, device="1x NVIDIA H100 80GB HBM3", torch="2.11.0+cu130",
                 memory_gib=79.2, float8=True)  # fmt: skip


def write_metrics(folder, losses, **extra):
    """A run's metrics.jsonl as train.py writes it: one MetricsLogger record per step."""
    logger = MetricsLogger(Metrics(enable_tensorboard=False), str(folder), enabled=True)
    for step, loss in enumerate(losses, 1):
        logger.log(step, {"loss": loss, "wps": 1000.0 * step, "mfu": 10.0 * step,
                          "memory_gib": 2.0 + step, "alloc_retries": 0, **extra})  # fmt: skip
    logger.close()
    return gc.read_jsonl(folder / "metrics.jsonl")


def test_summarize_drops_warmup_and_takes_peaks(tmp_path):
    records = write_metrics(tmp_path, [5.0, 4.0, 3.5, 3.0, 2.5, 2.0])
    fig = gc.summarize(records)
    # Steps 1-3 dropped for throughput: median of steps 4-6; memory over every step.
    assert fig["steps"] == 6
    assert fig["wps"] == 5000.0 and fig["mfu"] == 50.0
    assert fig["reserved_gib"] == 8.0 and fig["retries"] == 0
    assert (fig["loss_first"], fig["loss_last"]) == (5.0, 2.0)
    assert fig["active_gib"] is None  # a run that does not log active memory


def test_summarize_reads_active_memory_and_keeps_short_runs(tmp_path):
    records = write_metrics(tmp_path, [5.0, 4.0], memory_active_gib=1.5)
    fig = gc.summarize(records)
    assert fig["active_gib"] == 1.5
    assert fig["wps"] == 1500.0  # fewer steps than the warm-up: all of them count


@pytest.mark.parametrize(
    ("rc", "losses", "estimate", "verdict"),
    [
        (0, [5.0, 4.0], None, "PASS"),
        (1, [5.0, 4.0], None, "FAIL"),  # exit code
        (124, [], None, "FAIL"),  # timeout
        (0, [], None, "FAIL"),  # nothing logged
        (0, [5.0, 5.0], None, "FAIL"),  # loss did not fall
        (0, [5.0, float("nan")], None, "FAIL"),
        (0, [5.0, 4.0], 4.0 * 1.14, "PASS"),  # the measured peak is 4 GiB
        (0, [5.0, 4.0], 4.0 * 0.86, "PASS"),
        (0, [5.0, 4.0], 4.0 * 1.16, "FAIL"),
        (0, [5.0, 4.0], 4.0 * 0.84, "FAIL"),
    ],
)
def test_train_verdict(tmp_path, rc, losses, estimate, verdict):
    figures = gc.summarize(write_metrics(tmp_path, losses))
    result, why = gc.train_verdict(rc, figures, estimate)
    assert result == verdict, why
    assert bool(why) == (verdict == "FAIL")


def test_same_losses_is_bitwise_after_step_k(tmp_path):
    base = [5.0, 4.5, 4.25, 4.0]
    a = write_metrics(tmp_path / "a", base)
    assert gc.same_losses(a, write_metrics(tmp_path / "b", base)) == (
        "PASS",
        "4 steps after 0 bitwise equal",
    )
    # One ulp off at step 4: a float's last bit survives the JSONL round trip.
    ulp = write_metrics(tmp_path / "c", [*base[:3], 4.000000000000001])
    assert gc.same_losses(a, ulp)[0] == "FAIL"
    # Differences at or before step k do not count.
    early = write_metrics(tmp_path / "d", [9.0, 9.0, *base[2:]])
    assert gc.same_losses(a, early)[0] == "FAIL"
    assert gc.same_losses(a, early, after=2)[0] == "PASS"
    # A resumed run logs only the steps after k: compared on those.
    resumed = [r for r in a if r["step"] > 2]
    assert gc.same_losses(a, resumed, after=2)[0] == "PASS"
    # A run that stopped early, or logged nothing, fails.
    assert gc.same_losses(a, a[:3])[0] == "FAIL"
    assert gc.same_losses([], [])[0] == "FAIL"


def test_parse_estimate_reads_estimate_memory_output(capsys):
    spec = importlib.util.spec_from_file_location(
        "estimate_memory", REPO / "scripts" / "estimate_memory.py"
    )
    estimate_memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(estimate_memory)
    argv = ["--job.config_file", "debug_model.toml", "--vocab_size", "2048"]
    assert estimate_memory.main(argv) == 0
    text = capsys.readouterr().out
    total = float(text.split("total (estimated peak per rank)")[1].split()[0])
    context = float(text.split("context / NCCL / slack")[1].split()[0])
    assert context > 0  # the CUDA allowance the measured reserved memory does not include
    assert gc.parse_estimate(text) == pytest.approx(total - context)
    assert gc.parse_estimate("estimate_memory: error: bad flag") is None


def test_bench_loss_note():
    table = "\n".join([
        "| loss | peak memory over inputs (GiB) | vs plain | median fwd+bwd (s) | vs plain "
        "| loss value |",
        "|---|---:|---:|---:|---:|---:|",
        "| plain | 8.00 | 1.00 | 0.10 | 1.00 | 11.90 |",
        "| chunked 2048 | 2.00 | 0.25 | 0.13 | 1.30 | 11.90 |",
    ])  # fmt: skip
    assert gc.bench_loss_note(table) == "chunked 2048: 0.25x memory, 1.30x time"


def test_table_keeps_the_latest_row_of_each_run():
    row = {"device": GPU.device, "torch": GPU.torch, "command": "python train.py"}
    rows = [
        {**row, "name": "debug", "result": "FAIL", "why": "exit 1"},
        {**row, "name": "det_a=det_b", "result": "PASS", "command": "same | losses"},
        {**row, "name": "debug", "result": "PASS", "wps": 12345.6, "mfu": 38.25,
         "reserved_gib": 40.5, "retries": 0, "loss_first": 11.5, "loss_last": 7.25},
    ]  # fmt: skip
    lines = gc.format_table(rows).splitlines()
    body = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert [line.split(" | ")[0] for line in body] == ["| debug", "| det_a=det_b"]
    cells = body[0].strip("| ").split(" | ")
    assert len(cells) == len(gc.COLUMNS)
    assert cells[4:] == ["12,346", "38.2", "-", "40.50", "-", "0", "11.5000", "7.2500", "PASS"]
    assert "same \\| losses" in body[1]  # a pipe in a cell does not split it


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
    cfg = parse_args(gc.train_args(run, tmp_path, gc.Machine(0, "cpu", "2.13", 0.0, False, True)))
    assert (cfg.training.steps, cfg.training.seq_len) == (3, 32)


def test_runs_that_cannot_run_here_skip(tmp_path):
    no_f8 = gc.Machine(1, "1x A100", "2.11.0", 79.2, float8=False)
    row = gc.execute(gc.Run("f8", (), float8=True), tmp_path, no_f8, timeout_s=1)
    assert row["result"] == "SKIP" and "float8" in row["why"]
    assert gc.skip_reason(gc.Run("tp", (), nproc=2), GPU) == "needs 2 GPUs"
    assert gc.skip_reason(gc.Run("plain", ()), GPU) == ""


def test_layer_flavor_entry_adds_the_flavor_for_its_process_only(tmp_path, monkeypatch, capsys):
    """--_run gives "<flavor>_<N>L" the flavor's shape with N layers, without editing args.py."""
    flavors = dict(llama_args.LLAMA3_FLAVORS)
    monkeypatch.setattr(llama_args, "LLAMA3_FLAVORS", flavors)
    monkeypatch.setattr(sys, "argv", sys.argv)
    monkeypatch.setattr(sys, "path", list(sys.path))
    script = tmp_path / "show.py"
    script.write_text(
        "import sys\nfrom titanlite.models.llama.args import LLAMA3_FLAVORS\n"
        "print(sys.argv[1:], LLAMA3_FLAVORS['8B_4L'].n_layers, LLAMA3_FLAVORS['8B_4L'].dim)\n"
    )
    gc.run_entry([str(script), "--model.flavor", "8B_4L"])
    assert capsys.readouterr().out == "['--model.flavor', '8B_4L'] 4 4096\n"
    assert flavors["8B_4L"] == dataclasses.replace(flavors["8B"], n_layers=4)


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(capsys, tmp_path):
    cpu = {"torch": "2.13.0+cpu", "ngpu": 0, "device": "cpu", "memory_gib": 0.0, "sm": [0, 0],
           "torchao": False}  # fmt: skip
    assert gc.main(["--out", str(tmp_path / "out")], probe=lambda: cpu) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no CUDA GPU" in out
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_shell_script_without_a_gpu(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", GPU_CHECK_WHEELS=str(tmp_path))
    proc = subprocess.run([str(REPO / "scripts" / "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1 and "no CUDA GPU" in proc.stdout


@pytest.mark.slow
def test_cpu_smoke_runs_the_debug_stage_end_to_end(tmp_path):
    """The debug stage's four train.py runs (one under torchrun) and its bitwise comparison,
    tiny and on a CPU: the commands, the result rows and the table all work."""
    out = tmp_path / "out"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
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
