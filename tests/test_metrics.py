"""Metrics: FLOPs formula, peak FLOPs lookup and calibration, memory monitor, the metrics sink."""

import json
import logging
import math
from types import SimpleNamespace

import pytest
import torch
from wandb_offline import read_offline_run

from titanlite import metrics, metrics_sinks
from titanlite.config import JobConfig


def test_flops_per_token_hand_computed():
    args = SimpleNamespace(dim=256, n_layers=6, n_heads=16)
    # 6 * 1000 + 12 * 6 layers * 16 heads * 16 head_dim * 128 seq = 6000 + 2,359,296
    assert metrics.num_flops_per_token(1000, args, seq_len=128) == 2_365_296


def test_peak_override_wins():
    assert metrics.get_peak_flops(torch.device("cpu"), torch.float32, 123.0) == 123e12


def test_float8_reports_no_mfu_and_says_why(monkeypatch, caplog):
    _fake_cuda(monkeypatch, "NVIDIA H100 80GB HBM3")
    with caplog.at_level(logging.INFO, logger="titanlite.metrics"):
        assert metrics.get_peak_flops(torch.device("cuda", 0), torch.bfloat16, float8=True) is None
    assert "MFU not reported: float8" in caplog.text
    # A peak the user names (the float8 one, say) is theirs to measure against.
    assert metrics.get_peak_flops(torch.device("cuda", 0), torch.bfloat16, 1979.0, True) == 1979e12


def _fake_cuda(monkeypatch, name):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989.5),
        ("NVIDIA H100 PCIe", 756.5),
        ("NVIDIA H100 NVL", 835.5),
        ("NVIDIA H200", 989.5),
        ("NVIDIA H200 NVL", 835.5),
        ("NVIDIA GH200 480GB", 989.5),
        ("NVIDIA B200", 2250),
        ("NVIDIA GB200", 2500),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA A100 80GB PCIe", 312),
        ("AMD Instinct MI300X", 1307.4),
        ("NVIDIA H20", None),  # a different chip, not a shorter H200
        ("NVIDIA GB300", None),
    ],
)
def test_peak_table(monkeypatch, name, tflops):
    _fake_cuda(monkeypatch, name)
    peak = metrics.get_peak_flops(torch.device("cuda", 0), torch.bfloat16)
    assert peak == (tflops * 1e12 if tflops else None)


def test_unknown_gpu_returns_none_and_warns_once(monkeypatch, caplog):
    _fake_cuda(monkeypatch, "Imaginary GPU 9000")
    with caplog.at_level(logging.WARNING, logger="titanlite.metrics"):
        assert metrics.get_peak_flops(torch.device("cuda", 0), torch.bfloat16) is None
        assert metrics.get_peak_flops(torch.device("cuda", 0), torch.bfloat16) is None
    warnings = [r for r in caplog.records if "Imaginary GPU 9000" in r.getMessage()]
    assert len(warnings) == 1


def test_cpu_calibration_positive_and_cached(monkeypatch):
    first = metrics.get_peak_flops(torch.device("cpu"), torch.float32)
    assert first > 0 and math.isfinite(first)

    def no_second_measurement(*args, **kwargs):
        raise AssertionError("calibration ran twice")

    monkeypatch.setattr(torch, "randn", no_second_measurement)
    assert metrics.get_peak_flops(torch.device("cpu"), torch.float32) == first


def test_throughput():
    out = metrics.compute_throughput(1000, 2.0, 1e9, 1e13)
    assert out["wps"] == 500 and out["tflops"] == pytest.approx(0.5) and out["mfu"] == 5.0
    assert metrics.compute_throughput(1000, 2.0, 1e9, None)["mfu"] is None


def test_memory_monitor_cpu():
    monitor = metrics.DeviceMemoryMonitor(torch.device("cpu"))
    stats = monitor.get_peak_stats()
    assert stats.max_active_gib > 0 and stats.max_reserved_gib > 0
    assert 0 < stats.max_reserved_pct < 100
    assert stats.num_alloc_retries == 0 and stats.num_ooms == 0
    block = torch.ones(64 * 2**20, dtype=torch.uint8)  # touch 64 MiB: the peak cannot drop
    assert monitor.get_peak_stats().max_reserved_gib >= stats.max_reserved_gib
    del block
    monitor.reset_peak_stats()
    assert monitor.get_peak_stats().max_reserved_gib > 0


def _fake_cuda_memory(monkeypatch, counts: dict) -> metrics.DeviceMemoryMonitor:
    """A monitor of a fake 80 GiB GPU whose allocator counters are whatever `counts` holds."""
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 * 2**30)
    )
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: None)
    monkeypatch.setattr(
        torch.cuda,
        "memory_stats",
        lambda d: {"reserved_bytes.all.peak": 60 * 2**30, "active_bytes.all.peak": 45 * 2**30,
                   **counts},
    )  # fmt: skip
    return metrics.DeviceMemoryMonitor(torch.device("cuda", 0))


def test_allocator_retries_and_ooms_warn_when_they_grow(monkeypatch, caplog):
    counts = {"num_alloc_retries": 0, "num_ooms": 0}
    monitor = _fake_cuda_memory(monkeypatch, counts)

    def log(**new_counts) -> tuple[dict, list[str]]:
        counts.update(new_counts)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="titanlite.metrics"):
            values = monitor.log_values()
        return values, [r.getMessage() for r in caplog.records]

    values, warnings = log()
    expected = {"memory_gib": 60.0, "memory_active_gib": 45.0, "alloc_retries": 0, "ooms": 0}
    assert values == expected and not warnings
    values, warnings = log(num_alloc_retries=3)
    assert values["alloc_retries"] == 3 and len(warnings) == 1
    assert "3 more allocation retries (3 in all), 0 more out-of-memory" in warnings[0]
    for fix in ("local_batch_size", "activation_checkpoint", "expandable_segments:True"):
        assert fix in warnings[0]
    assert not log()[1]  # counts are cumulative: unchanged means nothing new
    values, warnings = log(num_ooms=1)
    assert values["ooms"] == 1 and "0 more allocation retries (3 in all), 1 more" in warnings[0]
    values, warnings = log(num_alloc_retries=5)
    assert "2 more allocation retries (5 in all)" in warnings[0]
    assert not log()[1]


def test_cpu_monitor_logs_zero_counts_and_no_warning(caplog):
    monitor = metrics.DeviceMemoryMonitor(torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="titanlite.metrics"):
        values = monitor.log_values()
    assert values["memory_gib"] > 0 and values["alloc_retries"] == values["ooms"] == 0
    assert "memory_active_gib" not in values  # the peak RSS is one number
    assert not caplog.records


def _cfg(**kw):
    base = dict(log_freq=1, enable_tensorboard=True, save_tb_folder="tb", enable_jsonl=True,
                enable_wandb=False, save_for_all_ranks=False)  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def test_logger_writes_jsonl_exactly_and_tensorboard(tmp_path, caplog):
    loss = 7.123456789012345
    sink = metrics.MetricsLogger(_cfg(), str(tmp_path))
    with caplog.at_level(logging.INFO, logger="titanlite.metrics"):
        sink.log(10, {"loss": torch.tensor(loss, dtype=torch.float64), "lr": 8e-4, "mfu": None})
        sink.log(20, {"loss": 1 / 3, "val_loss": 2.5, "wps": 2345.6, "memory_gib": 60.0,
                      "memory_active_gib": 45.0})  # fmt: skip
    sink.close()

    lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [10, 20]
    assert lines[0]["loss"] == loss and lines[1]["loss"] == 1 / 3
    assert lines[0]["mfu"] is None and lines[0]["grad_norm"] is None
    assert "val_loss" not in lines[0] and lines[1]["val_loss"] == 2.5
    assert "memory_active_gib" not in lines[0] and lines[1]["memory_active_gib"] == 45.0
    assert list(lines[0])[:2] == ["step", "loss"]

    console = caplog.records[0].getMessage()
    assert "loss  7.1235" in console and "lr 8.0e-04" in console and "mfu" not in console
    assert "wps 2,346" in caplog.records[1].getMessage()
    assert "mem 60.00GiB  active 45.00GiB" in caplog.records[1].getMessage()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_block_grad_norms_go_to_every_sink_but_the_console_shows_the_largest(tmp_path, caplog):
    sink = metrics.MetricsLogger(_cfg(), str(tmp_path))
    tags = {}
    (tb,) = [s for s in sink.sinks if isinstance(s, metrics_sinks.TensorBoardSink)]
    tb.writer.add_scalar = lambda tag, value, step: tags.update({tag: value})
    blocks = {"grad_norm/tok_embeddings": 0.5, "grad_norm/layers.0": 2.25, "grad_norm/output": 1}
    with caplog.at_level(logging.INFO, logger="titanlite.metrics"):
        sink.log(1, {"loss": 1.0, "grad_norm": 2.5, **blocks})
    sink.close()
    (record,) = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {k: record[k] for k in blocks} == blocks
    assert {k: tags[k] for k in blocks} == blocks  # TensorBoard: under grad_norm/
    console = caplog.records[0].getMessage()
    assert console.endswith("max_block layers.0 2.25") and "tok_embeddings" not in console


def test_logger_off_the_log_rank_writes_nothing(tmp_path, caplog):
    sink = metrics.MetricsLogger(_cfg(), str(tmp_path / "out"), rank=1, log_rank=0)
    with caplog.at_level(logging.INFO):
        sink.log(1, {"loss": 1.0})
    sink.close()
    assert not (tmp_path / "out").exists()
    assert not caplog.records


def test_save_for_all_ranks_gives_each_rank_its_own_files(tmp_path):
    cfg = _cfg(save_for_all_ranks=True)
    for rank in (0, 1):  # rank 1 is not the log rank: it writes all the same
        sink = metrics.MetricsLogger(cfg, str(tmp_path), rank=rank, log_rank=0)
        sink.log(5, {"loss": float(rank)})
        sink.close()
    for rank in (0, 1):
        assert list((tmp_path / "tb" / f"rank_{rank}").glob("events.out.tfevents.*"))
        (record,) = [json.loads(s) for s in (tmp_path / f"metrics_rank_{rank}.jsonl").open()]
        assert record["step"] == 5 and record["loss"] == rank
    assert not (tmp_path / "metrics.jsonl").exists()
    assert not list((tmp_path / "tb").glob("events.out.tfevents.*"))


# Three logged steps as train.py makes them: a tensor loss, Nones, integer counts, validation.
_STEPS = {
    1: {"loss": torch.tensor(7.123456789012345, dtype=torch.float64), "grad_norm": 1 / 3,
        "lr": 8e-4, "mfu": None, "memory_gib": 1.5, "alloc_retries": 0, "elapsed_s": 0.25},
    2: {"loss": 6.5, "grad_norm": 2.0, "lr": 4e-4, "mfu": 12.5, "alloc_retries": 1},
    4: {"loss": 5.25, "val_loss": 5.5, "val_ppl": math.exp(5.5)},
}  # fmt: skip


@pytest.mark.parametrize("all_ranks", [False, True], ids=["log_rank", "all_ranks"])
def test_wandb_logs_what_jsonl_logs(tmp_path, wandb_offline, all_ranks):
    """The real wandb, offline: every step's values as metrics.jsonl has them (under the
    TensorBoard names), the resolved config attached, and the exit code handed over."""
    cfg = _cfg(enable_wandb=True, enable_tensorboard=False, save_for_all_ranks=all_ranks)
    run_config = JobConfig().to_dict()
    dump = tmp_path / "dump"
    sink = metrics.MetricsLogger(cfg, str(dump), rank=1, log_rank=1, run_config=run_config)
    for step, values in _STEPS.items():
        sink.log(step, values)
    sink.close(exit_code=3)

    (run_dir,) = (dump / "wandb").glob("offline-run-*")
    run = read_offline_run(run_dir)
    jsonl_name = "metrics_rank_1.jsonl" if all_ranks else "metrics.jsonl"
    jsonl = [json.loads(s) for s in (dump / jsonl_name).open()]
    assert run.history == {r.pop("step"): metrics_sinks.tagged(r) for r in jsonl}
    assert run.history[1]["loss/global"] == 7.123456789012345 and "mfu_pct" not in run.history[1]
    assert run.history[4] == {"loss/global": 5.25, "loss/validation": 5.5,
                              "ppl/validation": math.exp(5.5)}  # fmt: skip
    assert run.config == run_config and run.config["metrics"]["enable_wandb"] is False
    assert run.exit_code == 3
    if all_ranks:  # the rank's own folder and name, in a group every rank derives alike
        assert run_dir.name.endswith("-rank_1") and run.name == "rank_1" and run.group == "dump"
    else:
        assert run.group == ""


def test_a_requeued_job_continues_its_wandb_run(tmp_path, wandb_offline, monkeypatch):
    """The real wandb, offline: a requeue of a SLURM job that resumes its checkpoint logs into
    the run its first start made; a fresh start in the same folder gets a run of its own."""
    cfg = _cfg(enable_wandb=True, enable_tensorboard=False)
    dump = tmp_path / "dump"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    run_ids = []
    for restart, resuming, steps in [(0, False, [1, 2]), (1, True, [3, 4]), (2, False, [1])]:
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
        sink = metrics.MetricsLogger(cfg, str(dump), resuming=resuming)
        for step in steps:
            sink.log(step, {"loss": float(step)})
        run_ids.append(sink.sinks[-1].run.id)
        sink.close(exit_code=0)
    first, requeued, fresh = run_ids
    assert first.startswith("slurm4242-0-") and requeued == first
    assert fresh.startswith("slurm4242-2-")
    assert (dump / "wandb" / "run_id").read_text().strip() == fresh
    # Offline, each start writes a folder of its own named with the run id (and "-1" when one of
    # that name was made in the same second); `wandb sync` joins them into one run.
    steps = {}
    for folder in (dump / "wandb").glob("offline-run-*"):
        run_id = next(i for i in (first, fresh) if i in folder.name)
        steps.setdefault(run_id, []).extend(read_offline_run(folder).history)
    assert {k: sorted(v) for k, v in steps.items()} == {first: [1, 2, 3, 4], fresh: [1]}


def test_init_logger_levels(monkeypatch):
    monkeypatch.setenv("LOG_RANK", "1")
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    try:
        metrics.init_logger(rank=1)
        assert root.level == logging.INFO
        metrics.init_logger(rank=0)
        assert root.level == logging.WARNING
    finally:
        root.handlers[:] = saved[1]
        root.setLevel(saved[0])


@pytest.mark.parametrize(
    "environ, cuda, expected",
    [
        ({}, True, "expandable_segments:True"),
        ({}, False, None),  # CPU: nothing to set
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, True, "max_split_size_mb:128"),
        ({"PYTORCH_CUDA_ALLOC_CONF": ""}, True, ""),  # empty: torch's own default, kept
        ({"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}, True, None),  # torch's generic name
    ],
)
def test_expandable_segments_unless_the_user_configured_the_allocator(environ, cuda, expected):
    before = dict(environ)
    metrics.default_expandable_segments(environ, cuda)
    assert environ.get("PYTORCH_CUDA_ALLOC_CONF") == expected
    assert {k: v for k, v in environ.items() if k in before} == before
