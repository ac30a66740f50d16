"""One place where a config becomes a job:

    TOML + CLI --parse_args--> JobConfig --resolve_job(config, world)--> Job

resolve_job checks every option first (titanlite/checks.py, pure checks), lets the planner pick
the layout under --parallelism.plan auto (a new config: the one it was given is left as it is),
then builds what the job is made of: the tokenizer, the model args, the parallel dims, the
global batch and its microbatches, the pipeline plan. The trainer, the dry run and the planner
(its CLI, calibration, plan auto's prediction) start from it; the seed checkpoint, generate.py,
prepare_data.py and the estimator, which need only the model or tokenizer, from resolve_model.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from titanlite.build import model_args_for, model_args_for_vocab
from titanlite.checks import check_job, check_options, check_run, check_tokenizer_fits
from titanlite.config import Checkpoint, ConfigError, JobConfig, Training
from titanlite.data.tokenizer import Tokenizer, build_tokenizer
from titanlite.models.pipeline_plan import PipelinePlan, plan_pipeline
from titanlite.parallel_dims import ParallelDims


class World(NamedTuple):
    """The ranks a job runs on: how many, and this rank's device where the job runs here (the
    trainer). device None: a world played or priced on this machine for other devices (the dry
    run): nothing is checked against a device, and the layout is the config's own
    (parallelism.plan auto plans for the devices the job finds, so only where it runs)."""

    size: int
    device: torch.device | None = None


class JobModel(NamedTuple):
    """A job's model as config and tokenizer make it, before anything is built."""

    tokenizer: Tokenizer | None  # None where the model was resolved for a given vocab size
    args: object  # the model family's args


@dataclass(frozen=True)
class Job:
    config: JobConfig  # what runs: under parallelism.plan auto, the planner's copy
    parallel_dims: ParallelDims
    tokenizer: Tokenizer | None  # None where the job was resolved for a given vocab size
    model_args: object  # the model family's args
    global_batch_size: int
    num_microbatches: int  # per rank and step (gradient accumulation)
    pipeline: PipelinePlan | None  # None without pipeline parallelism


def resolve_job(config: JobConfig, world: World, vocab_size: int | None = None) -> Job:
    """Every check that needs no data or weights, in the order a user meets them, and the job's
    objects; a ConfigError names the first mistake and its fix, before anything is built. With
    `vocab_size` no tokenizer is built (the planner pricing a cluster's job on a laptop)."""
    check_options(config)  # train.py ran them already, before its process group
    if config.parallelism.plan == "auto" and world.device is not None:
        # Here, not above: the planner resolves its models and batches with this module.
        from titanlite.plan.run import plan_layout

        config = plan_layout(config, world.size, world.device)
        check_options(config)  # the planned layout against the options the user set
    parallelism, training = config.parallelism, config.training
    parallel_dims = ParallelDims.from_config(parallelism, world.size)
    model = resolve_model(config, vocab_size)
    parallel_dims.validate_model(model.args)
    global_batch_size, num_microbatches = resolve_global_batch(training, parallel_dims.dp_degree)
    check_job(config, parallel_dims, model.args, global_batch_size, num_microbatches)
    pipeline = None
    if parallel_dims.pp_enabled:
        pipeline = plan_pipeline(
            model.args.n_layers, parallel_dims.pp, training.local_batch_size, parallelism
        )
    if world.device is not None:
        check_run(config, parallel_dims, model.args, world.device)
    return Job(
        config, parallel_dims, model.tokenizer, model.args, global_batch_size, num_microbatches,
        pipeline,
    )  # fmt: skip


def resolve_model(config: JobConfig, vocab_size: int | None = None) -> JobModel:
    """The run's tokenizer and model args (the vocab padded to shard evenly, or the vocab of the
    Hugging Face checkpoint the run starts from); with `vocab_size` no tokenizer is built (a
    cluster's tokenizer file, priced on a laptop)."""
    if vocab_size is not None:
        return JobModel(None, model_args_for_vocab(config, vocab_size))
    tokenizer = build_tokenizer(config.model)
    fixed = _fixed_vocab(config.checkpoint)
    if fixed is None:
        return JobModel(tokenizer, model_args_for(config, tokenizer))
    check_tokenizer_fits(tokenizer.n_words, *fixed)
    # The checkpoint's rows, which may be more than its tokenizer's ids (Qwen3: 151,936 rows
    # for 151,669 ids): its weights load as they are.
    args = model_args_for_vocab(config, fixed[0], tokenizer.bos_id, tokenizer.eos_id)
    return JobModel(tokenizer, args)


def _fixed_vocab(ckpt: Checkpoint) -> tuple[int, str] | None:
    """(vocab_size, where it is set) of the Hugging Face checkpoint a run starts from, whose
    vocabulary the tokenizer must fit; None where the run sizes its vocabulary itself."""
    if not (ckpt.initial_load_path and ckpt.initial_load_in_hf):
        return None
    path = Path(ckpt.initial_load_path).expanduser() / "config.json"
    if not path.is_file():  # the checkpoint plan names what the folder lacks
        return None
    vocab = json.loads(path.read_text()).get("vocab_size")
    return (vocab, f"vocab_size in {path}") if isinstance(vocab, int) else None


def resolve_global_batch(training: Training, dp_degree: int) -> tuple[int, int]:
    """(global batch size, microbatches per rank) for this data-parallel degree.

    global_batch_size -1 means one microbatch of local_batch_size rows on every dp rank; any other
    value must split evenly into local_batch_size-row microbatches on every dp rank.
    """
    lb = training.local_batch_size
    per_step = lb * dp_degree  # rows one microbatch on every dp rank covers
    g = per_step if training.global_batch_size == -1 else training.global_batch_size
    if g <= 0 or g % per_step:
        nearest = max(1, round(g / per_step)) * per_step
        raise ConfigError(
            f"training.global_batch_size ({g}) must be a positive multiple of "
            f"training.local_batch_size ({lb}) x data-parallel degree ({dp_degree}) = {per_step}; "
            f"e.g. {nearest}, or -1 for {per_step}"
        )
    return g, g // per_step
