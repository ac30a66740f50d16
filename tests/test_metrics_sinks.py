"""titanlite/metrics_sinks.py: the W&B run's names from the environment (the sinks' output is
tested through MetricsLogger in tests/test_metrics.py); the sample id log."""

import json
import re
from types import SimpleNamespace

import pytest

from titanlite.config import ConfigError
from titanlite.metrics_sinks import SampleIdLog, job_run_id, wandb_run_args


def test_wandb_run_args_from_the_environment(tmp_path):
    none = dict(project="titanlite", entity=None, name=None, id=None, group=None)
    assert wandb_run_args({}, None, tmp_path) == none
    env = {"WANDB_PROJECT": "p", "WANDB_TEAM": "t", "WANDB_RUN_NAME": "n", "WANDB_RUN_ID": "x"}
    assert wandb_run_args(env, None, tmp_path) == dict(
        project="p", entity="t", name="n", id="x", group=None
    )
    # save_for_all_ranks: a run per rank, in a group every rank names alike, with an id a
    # resume finds again.
    assert wandb_run_args(env, 3, tmp_path) == dict(
        project="p", entity="t", name="n-rank_3", id="x-rank_3", group="n"
    )
    args = wandb_run_args({"WANDB_ENTITY": "e"}, 3, tmp_path / "my_run")
    assert args["entity"] == "e" and args["name"] == "rank_3" and args["group"] == "my_run"
    assert args["id"].endswith("-rank_3")
    assert wandb_run_args({"WANDB_RUN_GROUP": "g", **env}, 0, tmp_path)["group"] == "g"


@pytest.mark.parametrize(
    "environ, prefix",
    [
        ({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "3"}, "slurm77-3-"),
        ({"SLURM_JOB_ID": "77"}, "slurm77-0-"),
        ({"TORCHELASTIC_RUN_ID": "a/b", "TORCHELASTIC_RESTART_COUNT": "1"}, "a-b-1-"),
        ({"TORCHELASTIC_RUN_ID": "none"}, ""),  # torchrun's default: no id of the job
        ({}, ""),
    ],
)
def test_job_run_id(tmp_path, environ, prefix):
    """A fresh start's id comes from the job (the same on every rank) and the folder, and is
    saved; a resume of the folder's checkpoint reads it back, whatever the job now is."""
    dump = tmp_path / "run"
    (dump / "wandb").mkdir(parents=True)
    run_id = job_run_id(environ, dump, resuming=False)
    assert run_id.startswith(prefix) and re.fullmatch(r"[A-Za-z0-9_-]+", run_id)
    if prefix:  # every rank derives the same id; the folder is part of it
        assert job_run_id(environ, dump, resuming=False) == run_id
        assert job_run_id(environ, tmp_path / "other", resuming=False) != run_id
    assert job_run_id({"SLURM_JOB_ID": "99"}, dump, resuming=True) == run_id


def test_sample_id_log_writes_the_served_steps_samples(tmp_path):
    served = SimpleNamespace(step=0)
    loader = SimpleNamespace(
        sharded=False,
        state_dict=lambda: {"step": served.step},
        step_samples=lambda step: [10 * step, 10 * step + 1],
    )
    log = SampleIdLog(True, str(tmp_path), True, loader)
    for step in (1, 2, 2):  # step 2 redone after a restart: logged again
        served.step = step
        log.write(step)
    log.close()
    lines = (tmp_path / "sample_ids.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "samples": [0, 1]}, {"step": 2, "samples": [10, 11]},
        {"step": 2, "samples": [10, 11]},
    ]  # fmt: skip
    SampleIdLog(True, str(tmp_path / "other"), False, loader).write(1)  # not the log rank
    assert not (tmp_path / "other").exists()
    with pytest.raises(ConfigError, match="debug.log_sample_ids needs map-style data"):
        SampleIdLog(True, str(tmp_path), True, SimpleNamespace(sharded=True))


def test_a_mixtures_per_source_losses_are_tagged_beside_the_loss():
    from titanlite.metrics_sinks import tagged

    floats = {"loss": 3.0, "loss/web": 3.5, "val_loss": 2.0, "val_loss/web": 2.5}
    assert tagged(floats) == {
        "loss/global": 3.0, "loss/web": 3.5, "loss/validation": 2.0, "loss/validation/web": 2.5,
    }  # fmt: skip
