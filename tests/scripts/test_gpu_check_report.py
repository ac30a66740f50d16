"""scripts/gpu_check_report.py: the pass rules and the table, on synthetic metrics.jsonl files
written by titanlite's own MetricsLogger (so the key names are the ones train.py writes) and on
the text the real estimate_memory.py prints."""

import importlib.util

import pytest
from conftest import REPO

from titanlite.config import Metrics
from titanlite.metrics import MetricsLogger


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = load_script("gpu_check_report")


def write_metrics(folder, losses, **extra):
    """A run's metrics.jsonl as train.py writes it: one MetricsLogger record per step."""
    logger = MetricsLogger(Metrics(enable_tensorboard=False), str(folder))
    for step, loss in enumerate(losses, 1):
        logger.log(step, {"loss": loss, "wps": 1000.0 * step, "mfu": 10.0 * step,
                          "memory_gib": 2.0 + step, "alloc_retries": 0, **extra})  # fmt: skip
    logger.close()
    return report.read_jsonl(folder / "metrics.jsonl")


def test_summarize_drops_warmup_and_takes_peaks(tmp_path):
    records = write_metrics(tmp_path, [5.0, 4.0, 3.5, 3.0, 2.5, 2.0])
    fig = report.summarize(records)
    # Steps 1-3 dropped for throughput: median of steps 4-6; memory over every step.
    assert fig["steps"] == 6
    assert fig["wps"] == 5000.0 and fig["mfu"] == 50.0
    assert fig["reserved_gib"] == 8.0 and fig["retries"] == 0
    assert (fig["loss_first"], fig["loss_last"]) == (5.0, 2.0)
    assert fig["active_gib"] is None  # a run that does not log active memory


def test_summarize_reads_active_memory_and_keeps_short_runs(tmp_path):
    records = write_metrics(tmp_path, [5.0, 4.0], memory_active_gib=1.5)
    fig = report.summarize(records)
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
    figures = report.summarize(write_metrics(tmp_path, losses))
    result, why = report.train_verdict(rc, figures, estimate)
    assert result == verdict, why
    assert bool(why) == (verdict == "FAIL")


def test_same_losses_is_bitwise_after_step_k(tmp_path):
    base = [5.0, 4.5, 4.25, 4.0]
    a = write_metrics(tmp_path / "a", base)
    assert report.same_losses(a, write_metrics(tmp_path / "b", base)) == (
        "PASS",
        "4 steps after 0 bitwise equal",
    )
    # One ulp off at step 4: a float's last bit survives the JSONL round trip.
    ulp = write_metrics(tmp_path / "c", [*base[:3], 4.000000000000001])
    assert report.same_losses(a, ulp)[0] == "FAIL"
    # Differences at or before step k do not count.
    early = write_metrics(tmp_path / "d", [9.0, 9.0, *base[2:]])
    assert report.same_losses(a, early)[0] == "FAIL"
    assert report.same_losses(a, early, after=2)[0] == "PASS"
    # A resumed run logs only the steps after k: compared on those.
    resumed = [r for r in a if r["step"] > 2]
    assert report.same_losses(a, resumed, after=2)[0] == "PASS"
    # A run that stopped early, or logged nothing, fails.
    assert report.same_losses(a, a[:3])[0] == "FAIL"
    assert report.same_losses([], [])[0] == "FAIL"


def test_same_losses_within_a_relative_tolerance(tmp_path):
    base = [5.0, 4.5, 4.25, 4.0]
    a = write_metrics(tmp_path / "a", base)
    close = write_metrics(tmp_path / "b", [5.0, 4.5, 4.2504, 4.0])  # 1e-4 relative at step 3
    assert report.same_losses(a, close)[0] == "FAIL"
    assert report.same_losses(a, close, rtol=1e-3) == (
        "PASS",
        "max |loss difference| 0.0004 over 4 steps after 0 (tolerance 0.001 relative)",
    )
    assert report.same_losses(a, close, rtol=5e-5)[0] == "FAIL"
    assert report.same_losses(a, a, rtol=1e-3)[1] == "4 steps after 0 bitwise equal"


def test_parse_estimate_reads_estimate_memory_output(capsys):
    estimate_memory = load_script("estimate_memory")
    argv = ["--job.config_file", "debug_model.toml", "--vocab_size", "2048"]
    assert estimate_memory.main(argv) == 0
    text = capsys.readouterr().out
    total = float(text.split("total (estimated peak per rank)")[1].split()[0])
    rows = dict(line.rsplit(None, 1) for line in text.splitlines() if line.startswith("context"))
    allowance = float(rows.get("context / NCCL / slack", 0))
    assert 0 < report.parse_estimate(text) == pytest.approx(total - allowance)
    assert report.parse_estimate("estimate_memory: error: bad flag") is None


def test_parse_estimate_leaves_out_memory_outside_the_allocator():
    row = "{:<34} {:>9.3f}".format
    table = [row("params (fp32, sharded)", 10.0), row("context / NCCL / slack", 2.0)]
    total = row("total (estimated peak per rank)", 12.0)
    assert report.parse_estimate("\n".join([*table, total])) == 10.0
    assert report.parse_estimate("\n".join([table[0], total])) == 12.0


def test_bench_loss_note():
    table = "\n".join([
        "| loss | peak memory over inputs (GiB) | vs plain | median fwd+bwd (ms) | vs plain "
        "| loss value |",
        "|---|---:|---:|---:|---:|---:|",
        "| plain | 8.00 | 1.00 | 0.10 | 1.00 | 11.90 |",
        "| chunked 2048 | 2.00 | 0.25 | 0.13 | 1.30 | 11.90 |",
    ])  # fmt: skip
    assert report.bench_loss_note(table) == "chunked 2048: 0.25x memory, 1.30x time"


def test_table_keeps_the_latest_row_of_each_run():
    row = {"device": "1x NVIDIA H100 80GB HBM3", "torch": "2.11.0", "command": "python train.py"}
    rows = [
        {**row, "name": "debug", "result": "FAIL", "why": "exit 1"},
        {**row, "name": "det_a=det_b", "result": "PASS", "command": "same | losses"},
        {**row, "name": "debug", "result": "PASS", "wps": 12345.6, "mfu": 38.25,
         "reserved_gib": 40.5, "retries": 0, "loss_first": 11.5, "loss_last": 7.25},
    ]  # fmt: skip
    lines = report.format_table(rows, "--job.config_file debug_model.toml").splitlines()
    assert "`--job.config_file debug_model.toml`" in lines[0]
    body = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert [line.split(" | ")[0] for line in body] == ["| debug", "| det_a=det_b"]
    cells = body[0].strip("| ").split(" | ")
    assert len(cells) == len(report.COLUMNS)
    assert cells[4:] == ["12,346", "38.2", "-", "40.50", "-", "0", "11.5000", "7.2500", "PASS"]
    assert "same \\| losses" in body[1]  # a pipe in a cell does not split it
