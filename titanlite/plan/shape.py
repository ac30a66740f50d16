"""What the planner reads from a job config: the model's shape and a Layout of the config's own
options (for --predict, calibration and the record a training run writes); and the memory
estimator's MemorySetup, of a planner's Layout or of a config (the dry run, estimate_memory.py)."""

from dataclasses import dataclass, replace

import torch

from titanlite.build import count_params
from titanlite.config import ConfigError, JobConfig
from titanlite.float8 import float8_enabled
from titanlite.job import Job, resolve_global_batch, resolve_model
from titanlite.memory_estimate import MemorySetup, param_counts
from titanlite.models import get_family
from titanlite.parallel_dims import ParallelDims
from titanlite.plan.perf import AC_CONFIG, Layout, Shape, pipeline_options


@dataclass(frozen=True)
class Model:
    """A model as the planner sees it: its args (for the memory estimator) and its Shape."""

    name: str  # model.name
    args: object
    counts: dict
    shape: Shape
    optimizer: str = "AdamW"  # optimizer.name: the states the estimator counts


def model_of(config: JobConfig, vocab_size: int, seq_len: int | None = None) -> Model:
    """The config's model at `vocab_size` (padded) and `seq_len` (default the config's)."""
    if seq_len:
        config = replace(config, training=replace(config.training, seq_len=seq_len))
    seq = config.training.seq_len
    args = resolve_model(config, vocab_size).args
    counts = param_counts(args, config.model.name)
    family = get_family(config.model.name)
    shape = Shape(
        dim=args.dim,
        ffn_dim=args.ffn_hidden_dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        head_dim=args.head_dim,
        kv_dim=args.num_kv_heads * args.head_dim,
        vocab=args.vocab_size,
        block_linear_params=counts["block_split"],
        params_total=counts["total"],
        # train.py's count: without the embedding, unless it is the output projection too.
        flops_per_token=family.flops_per_token(count_params(config, args, True), args, seq),
        seq_len=seq,
        optimizer=config.optimizer.name,
    )
    return Model(config.model.name, args, counts, shape, config.optimizer.name)


def layout_of(job: Job) -> Layout:
    """The layout a resolved job runs (titanlite/job.py resolve_job: degrees and microbatches)."""
    return _layout(job.config, job.parallel_dims, job.num_microbatches)


def _layout(config: JobConfig, pd: ParallelDims, accumulation: int = 1) -> Layout:
    p, t, ac = config.parallelism, config.training, config.activation_checkpoint
    # selective 'N' (every Nth block) has no planner value: modelled as 'op'.
    planned = {v: k for k, v in AC_CONFIG.items()}.get((ac.mode, ac.selective_ac_option), ac.mode)
    return Layout(
        tp=pd.tp, cp=pd.cp, pp=pd.pp, dp_replicate=pd.dp_replicate, dp_shard=pd.dp_shard,
        schedule=p.pipeline_parallel_schedule, local_batch_size=t.local_batch_size,
        pp_microbatch_size=p.pipeline_parallel_microbatch_size,
        accumulation=accumulation, ac=planned, chunk_tokens=config.loss.chunk_tokens,
        float8=float8_enabled(config), compile=config.compile.enable,
    )  # fmt: skip


def memory_setup(model_args, model_name: str, seq_len: int, lo: Layout, device: str = "cuda",
                 **run) -> MemorySetup:  # fmt: skip
    """The estimator's MemorySetup of layout `lo`, the one place a MemorySetup is built. `run`:
    what a job config sets beyond a layout (dtype, CPU offload, the pipeline rank...) or states
    itself (its loss_parallel and pipeline options); a planner's layout takes MemorySetup's
    defaults, loss parallel under TP, and its own pipeline options."""
    ac_mode, option = AC_CONFIG[lo.ac]
    run = dict(loss_parallel=lo.tp > 1, pp_options=pipeline_options(lo),
               selective_ac_option=option) | run  # fmt: skip
    run.setdefault("compiled_loss", lo.compile and not run["loss_parallel"])
    return MemorySetup(
        model_args=model_args, model_name=model_name, local_batch_size=lo.local_batch_size,
        seq_len=seq_len, dp_replicate=lo.dp_replicate, dp_shard=lo.dp_shard, tp=lo.tp, cp=lo.cp,
        ac_mode=ac_mode, chunk_tokens=lo.chunk_tokens, pp=lo.pp, device=device,
        compiled=lo.compile, accumulation=lo.accumulation, **run,
    )  # fmt: skip


def setup_from_config(
    config: JobConfig, world_size: int, model_args, device: str = "cuda", rank: int = 0
) -> MemorySetup:
    """A MemorySetup from a parsed JobConfig (degrees resolved for `world_size`) and the run's
    model args (titanlite.build makes them, as for training), for the pipeline rank of global
    `rank` (pipeline stages are the mesh's outermost dim). The estimate is of one microbatch's
    step, so the global batch is not checked here: training and the planner check it."""
    p, t, ac = config.parallelism, config.training, config.activation_checkpoint
    pd = ParallelDims.from_config(p, world_size)
    return memory_setup(
        model_args, config.model.name, t.seq_len, _layout(config, pd, _accumulation(t, pd)), device,
        selective_ac_option=ac.selective_ac_option,
        param_dtype=_compute_dtype_name(t.mixed_precision_param, device),
        loss_parallel=pd.loss_parallel(p), reshard_after_forward=p.fsdp_reshard_after_forward,
        cpu_offload=t.enable_cpu_offload, pp_rank=rank // (world_size // pd.pp), pp_options=p,
        optimizer=config.optimizer.name, state_dtype=config.optimizer.state_dtype,
    )  # fmt: skip


def _accumulation(training, pd: ParallelDims) -> int:
    """Microbatches per step; 1 where the global batch does not divide (training says so)."""
    try:
        return resolve_global_batch(training, pd.dp_degree)[1]
    except ConfigError:
        return 1


def _compute_dtype_name(choice: str, device: str) -> str:
    """ "auto" as train.py resolves it on the target device: the GPUs this estimates for have
    fast bf16; a CPU is this machine, so its own answer is the right one."""
    if choice != "auto":
        return choice
    if device == "cuda":
        return "bfloat16"
    from titanlite.precision import resolve_param_dtype

    return str(resolve_param_dtype(choice, torch.device(device))).removeprefix("torch.")


LLAMA3_VOCAB = 128256


def vocab_size_of(config: JobConfig) -> tuple[int, str]:
    """(the padded vocab of the config's tokenizer, ''), or Llama 3's and why where the tokenizer
    cannot be built here (a cluster's tokenizer file, planned for on a laptop)."""
    from titanlite.data.tokenizer import build_tokenizer
    from titanlite.models import pad_vocab

    try:
        return pad_vocab(build_tokenizer(config.model).n_words), ""
    except (OSError, ValueError) as e:
        return LLAMA3_VOCAB, f"tokenizer not available here ({e}); Llama 3's vocab assumed"
