"""titanlite/metrics_sinks.py: the W&B run's names from the environment (the sinks' output is
tested through MetricsLogger in tests/test_metrics.py)."""

from titanlite.metrics_sinks import wandb_run_args


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
