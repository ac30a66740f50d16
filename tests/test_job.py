"""titanlite/job.py: resolve_job, the one place a config becomes a job; under plan auto the
planner's choice is a new config, and the config it was given is left as it is."""

import dataclasses

import pytest
import torch
from conftest import TINY_TRAIN

from titanlite.config import ConfigError
from titanlite.config_parse import parse_args
from titanlite.job import World, resolve_job, resolve_model

PLAN_AUTO = ["--parallelism.plan", "auto", "--parallelism.plan_device", "h100-sxm"]


def test_plan_auto_resolves_to_the_planners_new_config(tmp_path):
    config = parse_args([*TINY_TRAIN, *PLAN_AUTO, "--job.dump_folder", str(tmp_path),
                         "--training.global_batch_size", "16"])  # fmt: skip
    before = dataclasses.asdict(config)
    job = resolve_job(config, World(4, torch.device("cpu")))
    assert dataclasses.asdict(config) == before  # nothing rewrote the given config
    planned = job.config
    assert planned is not config and planned.training.global_batch_size == 16
    degrees = job.parallel_dims
    assert degrees.dp_replicate * degrees.dp_shard * degrees.cp * degrees.tp * degrees.pp == 4
    per_rank = planned.training.local_batch_size * job.num_microbatches
    assert job.global_batch_size == 16 == per_rank * degrees.dp_degree


def test_a_world_without_a_device_plays_the_configs_own_layout():
    """The dry run: its CPU plays the job's GPUs, so neither the planner nor device checks."""
    config = parse_args([*TINY_TRAIN, *PLAN_AUTO, "--parallelism.tensor_parallel_degree", "2"])
    job = resolve_job(config, World(4))
    assert job.config is config and (job.parallel_dims.tp, job.parallel_dims.dp_shard) == (2, 2)
    assert job.tokenizer is not None and job.model_args.vocab_size == 640


def test_the_options_are_checked_before_anything_is_resolved():
    config = parse_args([*TINY_TRAIN, "--checkpoint.load_step", "3"])
    with pytest.raises(ConfigError, match="needs --checkpoint.enable"):
        resolve_job(config, World(1))


def test_a_model_for_a_given_vocab_builds_no_tokenizer():
    config = parse_args(TINY_TRAIN)
    model = resolve_model(config, vocab_size=1024)
    assert model.tokenizer is None and model.args.vocab_size == 1024
    assert resolve_model(config).args.vocab_size == 640  # 512 + specials, padded


def test_a_tokenizer_larger_than_the_checkpoints_vocabulary_is_one_line(tmp_path):
    """Starting from an HF folder, its config.json's vocab_size is the model's vocabulary."""
    (tmp_path / "config.json").write_text('{"vocab_size": 256}')
    load = ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(tmp_path)]
    config = parse_args([*TINY_TRAIN, *load])
    with pytest.raises(ConfigError) as info:
        resolve_model(config)
    n_words = resolve_model(parse_args(TINY_TRAIN)).tokenizer.n_words
    assert str(info.value) == (
        f"the tokenizer has {n_words} ids but the model's vocabulary (vocab_size in "
        f"{tmp_path / 'config.json'}) has 256 rows: set model.tokenizer_path to the model's own "
        f"tokenizer (at most 256 ids), or start from a checkpoint with at least {n_words} rows"
    )
    # A checkpoint with more rows than the tokenizer has ids (Qwen3's) keeps them all.
    (tmp_path / "config.json").write_text(f'{{"vocab_size": {n_words + 300}}}')
    assert resolve_model(parse_args([*TINY_TRAIN, *load])).args.vocab_size == n_words + 300
