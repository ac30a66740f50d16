"""The rehearsal (`--comm.mode fake_backend --comm.fake_steps N`): real training steps of one
rank of the target world over fake collectives, measured, as train.py runs it."""

import json

import pytest
from conftest import config_error, run_train

SMALL = ["--job.config_file", "debug_model.toml", "--model.vocab_limit", "512"]
SMALL += ["--training.seq_len", "32", "--training.local_batch_size", "2"]
SMALL += ["--training.mixed_precision_param", "float32", "--no-metrics.enable_tensorboard"]
PAR = "--parallelism."


def rehearse(tmp_path, rank, world, steps, *args):
    """train.py rehearsing rank `rank` of `world` for `steps` steps: (its report, its log)."""
    argv = [*SMALL, "--comm.mode", "fake_backend", "--comm.fake_world_size", str(world),
            "--comm.fake_rank", str(rank), "--comm.fake_steps", str(steps), *args,
            "--job.dump_folder", str(tmp_path)]  # fmt: skip
    proc = run_train(argv, timeout=300)
    return json.loads((tmp_path / "dry_run.json").read_text()), proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, args, share",
    [
        ("pp=1, dp_replicate=1, dp_shard=8, cp=1, tp=1", [], 1 / 8),
        ("pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=2",
         [PAR + "tensor_parallel_degree", "2"], 1 / 8),
        # Rank 3 is on the first of two stages: the embedding and layers 0-2, sharded 4 ways.
        ("pp=2, dp_replicate=1, dp_shard=4, cp=1, tp=1",
         [PAR + "pipeline_parallel_degree", "2"], (163_840 + 3 * 852_480) / 5_442_816 / 4),
    ],
)  # fmt: skip
def test_rehearsal_runs_real_steps_of_rank_3_of_8(tmp_path, layout, args, share):
    report, log = rehearse(tmp_path, 3, 8, 2, *args)
    assert (report["world_size"], report["rank"]) == (8, 3)
    assert layout in report["layout"]
    assert report["steps"] == 2 and len(report["step_seconds"]) == 2
    assert all(s > 0 for s in report["step_seconds"])
    assert report["tokens_per_s_per_device"] > 0
    assert report["measured_peak_gib"]["rss"] > 0.1  # the process itself: torch alone is more
    assert report["estimated_peak_gib"] > 0
    assert set(report["fake_collectives"].values()) <= {"copied", "untouched"}
    assert log.count("meaningless") == 1  # said once
    # 5.44 M parameters in all at vocab 640 (512 padded up): 163,840 in the embedding and as
    # many in the output, 852,480 per layer.
    assert report["params_local"] == pytest.approx(5_442_816 * share, rel=0.02)


@pytest.mark.slow
def test_rehearsal_of_the_last_stage_and_a_diverging_run_does_not_stop(tmp_path):
    """A learning rate that makes the weights non-finite after the first update stops a real run
    (training.on_nonfinite stop); a rehearsal takes every step. Rank 7 of PP 2 x CP 2 x FSDP 2
    is on the last stage, which receives the hidden states' description (their sequence split
    by CP) it would get from the first stage's rank."""
    args = [PAR + "pipeline_parallel_degree", "2", PAR + "context_parallel_degree", "2"]
    args += ["--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0"]
    report, _ = rehearse(tmp_path, 7, 8, 3, *args, "--training.on_nonfinite", "stop")
    assert report["steps"] == 3 and report["rank"] == 7
    assert "pp=2, dp_replicate=1, dp_shard=2, cp=2, tp=1" in report["layout"]


def test_fake_steps_without_the_fake_backend_is_an_error():
    assert "--comm.mode fake_backend" in config_error([*SMALL, "--comm.fake_steps", "2"])
