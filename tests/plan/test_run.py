"""The planner inside a training run: --parallelism.plan auto, and the prediction every run logs."""

import json
import logging
import re

import pytest
import torch
from conftest import TINY_TRAIN, run_train

import train
from titanlite.config import ConfigError
from titanlite.config_parse import parse_args
from titanlite.job import World, resolve_job
from titanlite.plan import calibrate
from titanlite.plan.devices import device_named
from titanlite.plan.run import plan_layout, prediction
from titanlite.plan.shape import layout_of


@pytest.mark.parametrize("name, entry", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA B200", "b200"),
    ("NVIDIA GH200 480GB", None), ("NVIDIA L40S", None),
])  # fmt: skip
def test_gpu_names_map_to_device_table_entries(name, entry):
    assert device_named(name) == entry


def test_plan_auto_sets_the_fastest_layout_on_the_config():
    cfg = parse_args([*TINY_TRAIN, "--parallelism.plan", "auto", "--parallelism.plan_device",
                      "h100-sxm", "--training.global_batch_size", "16"])  # fmt: skip
    planned = plan_layout(cfg, 4, torch.device("cpu"))
    lo = layout_of(resolve_job(planned, World(4)))
    assert lo.world == 4 and lo.global_batch == 16 and planned != cfg


@pytest.mark.parametrize("extra, message", [
    (["--parallelism.plan_device", "h100-sxm", "--training.global_batch_size", "-1"],
     "set --training.global_batch_size"),
    (["--training.global_batch_size", "8"], "set --parallelism.plan_device"),
    (["--training.global_batch_size", "8", "--parallelism.plan_device", "tpu"],
     "unknown device 'tpu'"),
])  # fmt: skip
def test_plan_auto_refuses_what_it_cannot_plan(extra, message):
    cfg = parse_args([*TINY_TRAIN, "--parallelism.plan", "auto", *extra])
    with pytest.raises(ConfigError, match=message):
        plan_layout(cfg, 2, torch.device("cpu"))


def test_prediction_on_a_cpu_is_memory_alone_and_on_a_named_gpu_also_the_step():
    job = resolve_job(parse_args(TINY_TRAIN), World(1), 512)
    cpu = prediction(job, torch.device("cpu"))
    assert cpu["world_size"] == 1 and cpu["vocab_size"] == 512
    assert cpu["predicted_memory_gib"] > 0 and cpu["predicted_step_s"] is None
    job.config.parallelism.plan_device = "h200"
    assert prediction(job, torch.device("cpu"))["predicted_step_s"] > 0


@pytest.mark.parametrize("memory_gib, warns", [(1e-3, True), (1e3, False), (None, False)])
def test_a_run_predicted_not_to_fit_is_warned_before_anything_is_built(
    monkeypatch, caplog, memory_gib, warns
):
    """The tiny run against a host with memory_gib available to this rank (None: not known)."""
    memory = None if memory_gib is None else int(memory_gib * 2**30)
    monkeypatch.setattr("titanlite.plan.run.memory_per_local_rank", lambda: memory)
    job = resolve_job(parse_args(TINY_TRAIN), World(1), 512)
    with caplog.at_level(logging.INFO, logger="titanlite"):
        prediction(job, torch.device("cpu"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == int(warns), warnings
    if warns:
        said = (r"predicted peak 0\.1 GiB per rank \(largest: AdamW states .* GiB, params .* "
                r"GiB\) is more than the host memory available to this rank, 0\.0 GiB: the run "
                r"will likely run out of memory")  # fmt: skip
        assert re.match(said, warnings[0])
        assert "--loss.chunk_tokens" in warnings[0] and "--training.local_batch_size" in warnings[0]


@pytest.mark.slow
def test_an_elastic_restart_replans_and_its_runs_calibrate(tmp_path, capsys):
    """plan auto on 2 ranks under torchrun, then a resume on 1 (plain train.main): each run
    plans for its own world, saves the layout in config.toml and logs its prediction, which
    --calibrate reads back."""
    auto = [*TINY_TRAIN, "--parallelism.plan", "auto", "--parallelism.plan_device", "h100-sxm",
            "--training.global_batch_size", "8", "--checkpoint.enable",
            "--checkpoint.interval", "2", "--job.dump_folder", str(tmp_path)]  # fmt: skip
    two = run_train([*auto, "--training.steps", "2"], nproc=2)
    assert "plan auto:" in two.stdout
    saved = parse_args(["--job.config_file", str(tmp_path / "config.toml")])
    assert layout_of(resolve_job(saved, World(2))).world == 2
    assert train.main([*auto, "--training.steps", "8"]) == 0
    one = capsys.readouterr().out
    assert "plan auto:" in one and "step-2" in one.split("Loaded model")[1]
    saved = parse_args(["--job.config_file", str(tmp_path / "config.toml")])
    one_rank = layout_of(resolve_job(saved, World(1)))
    assert one_rank.world == 1 and one_rank.global_batch == 8
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r.get("world_size") for r in records] == [2, None, 1] + [None] * 5
    run = calibrate.read_run(tmp_path)  # the last run's world and vocab, from its first step
    assert run.layout == one_rank and run.model.shape.vocab == records[2]["vocab_size"]
