"""Smoke test of scripts/benchmarks/benchmark.py: one tiny config, two measured steps, outputs
exist."""

import csv
import importlib.util

from conftest import REPO, TINY_TRAIN


def load_benchmark():
    spec = importlib.util.spec_from_file_location(
        "benchmark", REPO / "scripts" / "benchmarks" / "benchmark.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_sweep_writes_table_csv_and_plot(tmp_path, monkeypatch, capsys):
    bench = load_benchmark()
    tiny = [*TINY_TRAIN, "--training.global_batch_size", "2"]  # one microbatch a step
    # A custom flavor exercises the --_train entry that adds it to the flavor table.
    monkeypatch.setitem(bench.PRESETS, "smoke", [("tiny", 1, tiny, "64,2,4")])
    rc = bench.main(
        ["--preset", "smoke", "--warmup", "1", "--steps", "2", "--dump_folder", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "[1/1] tiny" in out and "tokens/s/device" in out
    bench_dir = tmp_path / "bench"
    table = (bench_dir / "results.md").read_text()
    assert "| tiny | 1 |" in table
    with open(bench_dir / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and rows[0]["config"] == "tiny"
    assert rows[0]["steps_measured"] == "2"
    assert float(rows[0]["tokens_per_s_per_device"]) > 0
    assert float(rows[0]["peak_memory_gib"]) > 0
    assert float(rows[0]["step_ms_min"]) <= float(rows[0]["step_ms_median"])
    png = (bench_dir / "results.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_summarize_drops_warmup_and_uses_elapsed_deltas():
    bench = load_benchmark()
    records = [
        {"step": s, "elapsed_s": e, "wps": w, "tflops": 1.0, "mfu": None, "memory_gib": m}
        for s, e, w, m in (
            (1, 5.0, 10, 1.0),
            (2, 6.0, 100, 2.0),
            (3, 8.0, 50, 1.5),
            (4, 9.0, 100, 1.0),
        )
    ]
    row = bench.summarize("x", 1, records, warmup=1)
    # Step times 5, 1, 2, 1 s; the warm-up step (5 s) is dropped.
    assert row["steps_measured"] == 3
    assert row["step_ms_median"] == 1000 and row["step_ms_max"] == 2000
    assert row["tokens_per_s_per_device"] == 100  # median wps of steps 2-4
    assert row["peak_memory_gib"] == 2.0 and row["mfu_pct"] is None
