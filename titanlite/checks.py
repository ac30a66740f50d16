"""Every check across options, before anything is built: what a job can get wrong that needs no
data, weights or device (the options against each other, then against the world size and the
model titanlite/job.py resolved), and the few that need the device. Checks only: each takes the
config and the objects resolve_job made, and builds nothing."""

import importlib.util
import os
import tempfile
from pathlib import Path

import torch
from torch.torch_version import TorchVersion

from titanlite.checkpoint.storage import (
    EXTRAS,
    missing_client,
    object_store_unwritable,
    url_scheme,
)
from titanlite.config import (
    Checkpoint,
    Comm,
    ConfigError,
    JobConfig,
    Metrics,
    Optimizer,
    Training,
    Validation,
    valid_selective_ac_option,
)
from titanlite.data.cache import cache_root
from titanlite.data.mixture import check_mixture
from titanlite.data.prepared import is_prepared
from titanlite.data.sources import HUB_DATASETS
from titanlite.float8 import FLOAT8, filtered, float8_enabled, torchao_float8
from titanlite.models import get_family
from titanlite.models.pipeline_plan import V_SHAPED, canonical_schedule
from titanlite.optim.groups import check_param_groups, parse_rule
from titanlite.parallel_dims import ParallelDims


def check_options(cfg: JobConfig) -> None:
    """Checks across options that need no world size (train.py runs them once the config is
    parsed, resolve_job before anything; single options are checked as they are read)."""
    get_family(cfg.model.name)  # a registered model family
    _check_checkpoint(cfg.checkpoint)
    _check_no_urls(cfg)
    _check_comm(cfg.comm)
    ratio = cfg.lr_scheduler.decay_ratio
    if ratio != -1 and not 0 <= ratio <= 1:
        raise ConfigError(
            f"lr_scheduler.decay_ratio must be in [0, 1], or -1 for all steps after warmup; "
            f"got {ratio}"
        )
    _check_data(cfg.training, cfg.validation)
    ac = cfg.activation_checkpoint
    option = ac.selective_ac_option
    if ac.mode == "selective" and not valid_selective_ac_option(option):
        raise ConfigError(
            "activation_checkpoint.selective_ac_option must be 'op', 'op_alternate' or a positive "
            f"integer N (checkpoint every Nth block), got {option!r}"
        )
    _check_early_step(cfg.optimizer, cfg.training, cfg.metrics)
    _check_optimizer(cfg.optimizer)
    _check_wandb_installed(cfg.metrics)


def _check_no_urls(cfg: JobConfig) -> None:
    """Checkpoints may live in object storage (s3://, gs://, through fsspec); the dump folder and
    the token cache are written by plain file calls, where a URL would be taken as a relative
    path (`s3:/...` under the working directory) that no other node reads."""
    ckpt = cfg.checkpoint
    for option, value in {
        "checkpoint.folder": ckpt.folder,
        "checkpoint.initial_load_path": ckpt.initial_load_path,
    }.items():
        scheme = url_scheme(value)
        if scheme is None:
            continue
        if scheme not in EXTRAS:
            raise ConfigError(
                f"{option} {value!r}: {scheme}:// is not supported; checkpoints go to a path or "
                "to object storage at s3://bucket/... or gs://bucket/..."
            )
        problem = missing_client(scheme)
        if problem:
            raise ConfigError(f"{option} {value!r}: {problem}")
    _check_object_store_options(ckpt)
    for option, value in {
        "job.dump_folder": cfg.job.dump_folder,
        "training.data_cache_dir": cfg.training.data_cache_dir,
    }.items():
        if url_scheme(value):
            raise ConfigError(
                f"{option} {value!r} is a URL: it must be a path on storage every node mounts "
                "(logs, metrics and the token cache are plain files); to keep checkpoints in "
                "object storage, set checkpoint.folder to an s3:// or gs:// URL instead"
            )


def _check_object_store_options(ckpt: Checkpoint) -> None:
    """What object-store checkpoints do not do (yet), each with the way round it."""
    if url_scheme(ckpt.folder) and ckpt.last_save_in_hf:
        raise ConfigError(
            f"checkpoint.last_save_in_hf writes a local folder, not to {ckpt.folder}: drop it and "
            "export the last step with `python scripts/convert_checkpoint.py dcp-to-hf "
            f"{ckpt.folder}/step-N OUT_DIR`"
        )
    if url_scheme(ckpt.folder) and ckpt.create_seed_checkpoint:
        raise ConfigError(
            "checkpoint.create_seed_checkpoint writes to a local checkpoint.folder only: write "
            "the seed locally and start runs from it with checkpoint.initial_load_path"
        )
    if url_scheme(ckpt.initial_load_path) and ckpt.initial_load_in_hf:
        raise ConfigError(
            f"checkpoint.initial_load_in_hf reads a local Hugging Face folder, not "
            f"{ckpt.initial_load_path}: download it first and give its local path"
        )


def _check_checkpoint(ckpt: Checkpoint) -> None:
    if ckpt.load_step >= 0 and not ckpt.enable:
        raise ConfigError(
            f"--checkpoint.load_step {ckpt.load_step} needs --checkpoint.enable (resuming reads "
            "the run's own checkpoint folder)"
        )
    _check_hf_options(ckpt)
    if ckpt.create_seed_checkpoint and (ckpt.initial_load_path or ckpt.load_step >= 0):
        raise ConfigError(
            "--checkpoint.create_seed_checkpoint writes fresh weights; it cannot be combined with "
            "checkpoint.initial_load_path or checkpoint.load_step"
        )


def _check_comm(comm: Comm) -> None:
    if comm.mode == "fake_backend" and not comm.fake_rank < comm.fake_world_size:
        raise ConfigError(
            f"--comm.mode fake_backend plays rank comm.fake_rank ({comm.fake_rank}) of "
            f"comm.fake_world_size ({comm.fake_world_size}) ranks: set --comm.fake_world_size N "
            "(the job's GPU count) and a rank below it"
        )
    if comm.mode == "default" and (
        comm.fake_world_size or comm.fake_rank or not comm.fake_init_weights or comm.fake_steps
    ):
        raise ConfigError(
            "comm.fake_world_size / comm.fake_rank / comm.fake_init_weights / comm.fake_steps "
            "only apply to a dry run or rehearsal: add --comm.mode fake_backend"
        )


def _check_data(t: Training, val: Validation) -> None:
    check_mixture(t, val)
    streams_local = t.dataset_streaming and t.dataset in ("python_stdlib", "local")
    if streams_local and not t.dataset_path:
        raise ConfigError(
            "--training.dataset_streaming streams local files: set training.dataset_path (hub "
            "datasets are always streamed; python_stdlib is tokenized into the cache)"
        )
    if streams_local and val.enable and not val.dataset_path:
        raise ConfigError(
            "validation of a streamed training.dataset_path needs validation.dataset_path: a "
            "stream has no end to hold out from"
        )
    if t.dataset_max_bad_rows and not t.dataset_path:
        raise ConfigError(
            "training.dataset_max_bad_rows skips bad rows of local files: set "
            "training.dataset_path (hub datasets and python_stdlib are read as they come)"
        )
    dl = t.dataloader
    if dl.num_workers == 0 and (dl.persistent_workers or dl.prefetch_factor):
        raise ConfigError(  # torch's DataLoader refuses them too without workers
            "training.dataloader.persistent_workers and prefetch_factor apply to worker "
            "processes: set --training.dataloader.num_workers N (N > 0) or leave them unset"
        )


def _check_early_step(optimizer: Optimizer, t: Training, metrics: Metrics) -> None:
    """A parameter stepped in backward is stepped before the other gradients exist: nothing
    that needs the whole step's gradients can come first (accumulation: check_early_step_batch)."""
    if not optimizer.early_step_in_backward:
        return
    if metrics.log_layer_grad_norms:
        raise ConfigError(
            "--metrics.log_layer_grad_norms reads every block's gradients after backward, but "
            "--optimizer.early_step_in_backward frees each one as soon as it is stepped: turn "
            "one of them off"
        )
    if t.on_nonfinite == "skip":
        raise ConfigError(
            "--optimizer.early_step_in_backward has stepped every parameter by the time a "
            "non-finite gradient norm is known, so the step cannot be skipped: use "
            "--training.on_nonfinite stop"
        )
    if t.on_loss_spike == "skip" and t.loss_spike_factor > 0:
        raise ConfigError(
            "--optimizer.early_step_in_backward has stepped every parameter by the time the "
            "step's loss is known, so a loss spike cannot be skipped: use "
            "--training.on_loss_spike report"
        )


def _check_optimizer(optimizer: Optimizer) -> None:
    """optimizer.groups' rules parse; bf16 states have an AdamW to go to; Muon's distributed
    step is not one parameter at a time."""
    rules = [parse_rule(text) for text in optimizer.groups]
    muon = optimizer.name == "Muon" or any(r.settings.get("optimizer") == "Muon" for r in rules)
    adamw = optimizer.name != "Adam" or any(r.settings.get("optimizer") == "AdamW" for r in rules)
    if optimizer.state_dtype == "bfloat16" and not adamw:
        raise ConfigError(
            "--optimizer.state_dtype bfloat16 keeps AdamW's moments in bf16, but no parameter "
            "is AdamW's: use --optimizer.name AdamW (or Muon, whose recipe steps the rest with "
            "AdamW)"
        )
    if muon and optimizer.early_step_in_backward:
        raise ConfigError(
            "--optimizer.early_step_in_backward steps each parameter alone, but Muon gathers its "
            "matrices and deals them over the ranks in one step: turn one of them off"
        )


def _check_wandb_installed(metrics: Metrics) -> None:
    # Found at parse time, not when the first rank logs: that comes after the model is built.
    if metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "metrics.enable_wandb needs the wandb package: pip install wandb (or "
            "titanlite[wandb]), or drop --metrics.enable_wandb"
        )


# (a checkpoint option, the option it needs, the one line that says so).
_CHECKPOINT_NEEDS = (
    ("initial_load_in_hf", "initial_load_path",
     "--checkpoint.initial_load_in_hf needs --checkpoint.initial_load_path (the folder with "
     "config.json and *.safetensors)"),
    ("initial_load_in_hf", "initial_load_model_only",
     "a Hugging Face folder holds only model weights: --checkpoint.initial_load_in_hf needs "
     "checkpoint.initial_load_model_only = true"),
    ("last_save_in_hf", "last_save_model_only",
     "--checkpoint.last_save_in_hf writes only the model weights (the HF format has no optimizer "
     "or data state): add --checkpoint.last_save_model_only"),
    ("last_save_model_only", "enable",
     "--checkpoint.last_save_model_only shapes the last checkpoint: add --checkpoint.enable"),
)  # fmt: skip


def _check_hf_options(ckpt: Checkpoint) -> None:
    for option, needed, message in _CHECKPOINT_NEEDS:
        if getattr(ckpt, option) and not getattr(ckpt, needed):
            raise ConfigError(message)


def check_early_step_batch(
    optimizer: Optimizer, global_batch_size: int, num_microbatches: int, dp_degree: int
) -> None:
    """optimizer.early_step_in_backward steps in every backward: a step must be one microbatch."""
    g = global_batch_size
    if optimizer.early_step_in_backward and num_microbatches > 1:
        raise ConfigError(
            "--optimizer.early_step_in_backward steps in every backward, but a step here is "
            f"{num_microbatches} microbatches per rank (gradient accumulation): set "
            f"--training.local_batch_size {g // dp_degree} (global batch {g} / data-parallel "
            f"degree {dp_degree}) for one"
        )


def check_job(
    cfg: JobConfig,
    parallel_dims: ParallelDims,
    model_args,
    global_batch_size: int,
    num_microbatches: int,
) -> None:
    """What a config can get wrong against its world that needs no data, weights or device: the
    batch split against early steps, float8, the optimizer's parameter groups, the pipeline's
    options (resolve_job runs it on the layout, model and global batch it resolved)."""
    check_early_step_batch(cfg.optimizer, global_batch_size, num_microbatches,
                           parallel_dims.dp_degree)  # fmt: skip
    check_float8(cfg, parallel_dims)
    with torch.device("meta"):  # the whole model, also under PP: a rule may select any part
        check_param_groups(cfg.optimizer, get_family(cfg.model.name).model_cls(model_args))
    # A typo fails with PP off too.
    p = cfg.parallelism
    schedule = canonical_schedule(p.pipeline_parallel_schedule, p.pipeline_parallel_schedule_csv)
    if parallel_dims.pp_enabled:
        check_pipeline_options(cfg)
        if model_args.tie_embeddings and schedule in V_SHAPED:
            # Its first and last stage share a rank as two modules, each FSDP's own root.
            raise ConfigError(
                f"a tied output (this flavor's) cannot train under the V-shaped pipeline "
                f"schedule {schedule}: choose another parallelism.pipeline_parallel_schedule "
                f"or an untied flavor"
            )


def check_tokenizer_fits(n_words: int, vocab_size: int, where: str) -> None:
    """The tokenizer's ids must be rows of a vocabulary the run does not size itself (a
    checkpoint it starts from): a larger one would index past the embedding."""
    if n_words > vocab_size:
        raise ConfigError(
            f"the tokenizer has {n_words} ids but the model's vocabulary ({where}) has "
            f"{vocab_size} rows: set model.tokenizer_path to the model's own tokenizer (at most "
            f"{vocab_size} ids), or start from a checkpoint with at least {n_words} rows"
        )


def check_run(cfg: JobConfig, parallel_dims: ParallelDims, model_args, device: torch.device):
    """The checks of a real run after check_job: those that need this run's device (the dry
    run, whose CPU plays the job's GPUs, skips them), then the output folders."""
    check_float8_device(cfg, device)
    check_attention_device(model_args, device)
    check_offload_device(cfg, parallel_dims, device, torch.__version__)
    check_output_folders(cfg)


def check_pipeline_options(cfg: JobConfig) -> None:
    """Options whose mechanics the pipeline schedule takes over, refused with the fix."""
    t, val = cfg.training, cfg.validation
    refused = {
        "optimizer.early_step_in_backward": cfg.optimizer.early_step_in_backward,
        "training.enable_cpu_offload": t.enable_cpu_offload,
        "training.accumulation_sync last (each schedule step reduces its gradients)": (
            t.accumulation_sync == "last"
        ),
        "validation.local_batch_size other than training's (the schedule's microbatches)": (
            val.enable and val.local_batch_size not in (-1, t.local_batch_size)
        ),
    }
    for what, on in refused.items():
        if on:
            raise ConfigError(f"pipeline parallelism does not support {what}; turn it off")


def check_float8(cfg, parallel_dims) -> None:
    """What a float8 config can get wrong that needs no device (config `cfg`: the JobConfig)."""
    if not float8_enabled(cfg):
        return
    f8 = cfg.quantize.linear.float8
    torchao_float8()
    if f8.enable_fsdp_float8_all_gather and f8.recipe_name != "tensorwise":
        raise ConfigError(
            "quantize.linear.float8.enable_fsdp_float8_all_gather needs one scale per weight: "
            f"set --quantize.linear.float8.recipe_name tensorwise (got {f8.recipe_name!r})"
        )
    if f8.enable_fsdp_float8_all_gather and not parallel_dims.fsdp_enabled:
        raise ConfigError(
            "quantize.linear.float8.enable_fsdp_float8_all_gather casts FSDP's weight "
            f"all-gather, but this layout ({parallel_dims}) has no FSDP: add data parallelism "
            "or leave it off"
        )
    if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
        raise ConfigError(
            "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp precomputes the "
            "scales of the float8 weight all-gather: add "
            "--quantize.linear.float8.enable_fsdp_float8_all_gather"
        )
    if f8.emulate and cfg.compile.enable:
        raise ConfigError(
            "quantize.linear.float8.emulate runs in eager mode only (torchao): drop "
            "--compile.enable, or drop emulate on a GPU of CUDA capability 8.9+"
        )
    if cfg.loss.chunk_tokens and not filtered("output", f8.filter_fqns):
        raise ConfigError(
            "the chunked loss (loss.chunk_tokens) reads output.weight directly, so a float8 "
            "output layer would run in high precision there: keep 'output' in "
            "quantize.linear.float8.filter_fqns or set --loss.chunk_tokens 0"
        )


def check_float8_device(cfg, device: torch.device) -> None:
    """Float8 matmuls need CUDA capability 8.9+ (Ada, Hopper, Blackwell) unless emulated. Not
    checked by the dry run, whose CPU plays the job's GPUs."""
    if not float8_enabled(cfg) or cfg.quantize.linear.float8.emulate:
        return
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability >= (8, 9):
            return
        where = f"a GPU of CUDA capability {capability[0]}.{capability[1]}"
    else:
        where = device.type
    raise ConfigError(
        f"float8 matmuls need a GPU of CUDA capability 8.9 or newer; this run is on {where}: "
        "add --quantize.linear.float8.emulate (same numerics with ordinary matmuls, slower: "
        f"for testing) or drop {FLOAT8} from model.converters"
    )


def check_offload_device(
    cfg: JobConfig, parallel_dims: ParallelDims, device: torch.device, torch_version: str
) -> None:
    """FSDP2's CPU offload on CUDA copies each gradient to pinned host memory without blocking,
    and two of its users read the copy before it has landed: silently wrong gradients. Not on
    CPU, where nothing is pinned and every copy is done when it returns."""
    if not cfg.training.enable_cpu_offload or device.type != "cuda":
        return
    if parallel_dims.dp_replicate > 1:
        # The reduce-scatter's output is reused while the all-reduce's copy to the host still
        # reads it (PyTorch PR 180665); no released torch is known to carry the fix.
        raise ConfigError(
            "HSDP (parallelism.data_parallel_replicate_degree > 1) with "
            "--training.enable_cpu_offload corrupts gradients on CUDA (FSDP2 reuses a buffer "
            "its device-to-host copy still reads): set "
            "--parallelism.data_parallel_replicate_degree 1 or drop training.enable_cpu_offload"
        )
    if cfg.optimizer.early_step_in_backward and TorchVersion(torch_version) < (2, 12):
        # Post-accumulate-grad hooks run before the copy is done (fixed by PyTorch PR 180666).
        raise ConfigError(
            "--optimizer.early_step_in_backward with --training.enable_cpu_offload steps on "
            f"partly copied gradients on CUDA with torch {torch_version} (fixed in 2.12): drop "
            "one of the two, or use torch >= 2.12"
        )


def check_attention_device(model_args, device: torch.device) -> None:
    if model_args.attention_backend == "flex" and device.type == "cpu":
        raise ConfigError(
            "model.attention_backend flex cannot train on CPU: torch has no CPU backward for "
            "flex attention; use sdpa (the same mask, dense) or auto"
        )


def check_single_process(cfg: JobConfig) -> None:
    """The dry run and the seed checkpoint are one process's work, whatever the target world."""
    what = "--comm.mode fake_backend" if cfg.comm.mode == "fake_backend" else (
        "--checkpoint.create_seed_checkpoint" if cfg.checkpoint.create_seed_checkpoint else None
    )  # fmt: skip
    if what and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        raise ConfigError(
            f"{what} runs in a single process: use plain `python train.py`, not torchrun "
            "(the dry run plays the world given by --comm.fake_world_size)"
        )


def check_output_folders(cfg: JobConfig) -> None:
    """The folders the job will write exist or can be made, and take a file: found once the
    options passed their checks (a refused job leaves no folder behind), on every rank, rather
    than as a traceback at the first save or, for the token cache, as a build that fails on
    rank 0 while the other ranks wait out training.data_build_timeout_s."""
    for what, folder in output_folders(cfg).items():
        check_writable(what, folder)
    if url_scheme(cfg.checkpoint.folder) and cfg.checkpoint.enable:
        # A wrong bucket or missing credentials fail here, not at the first save hours later.
        problem = object_store_unwritable(cfg.checkpoint.folder)
        if problem:
            raise ConfigError(f"checkpoint.folder {cfg.checkpoint.folder}: {problem}")


def output_folders(cfg: JobConfig) -> dict[str, Path]:
    """The folders the job writes, by the option that names them."""
    t = cfg.training
    folders = {"job.dump_folder": Path(cfg.job.dump_folder)}
    # Object storage is every node's, and made as it is written.
    on_disk = not url_scheme(cfg.checkpoint.folder)
    if on_disk and (cfg.checkpoint.enable or cfg.checkpoint.create_seed_checkpoint):
        folders["checkpoint.folder"] = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
    # A dataset_path wins over a hub dataset name (titanlite.data.sources.build_source).
    streamed = t.dataset_streaming or (t.dataset in HUB_DATASETS and not t.dataset_path)
    if not (streamed or is_prepared(t.dataset_path)):
        cache = "the token cache (training.data_cache_dir or TITANLITE_CACHE)"
        folders[cache] = cache_root(t.data_cache_dir)
    return folders


def check_writable(what: str, folder: Path) -> None:
    """`folder` exists or can be made, and takes a file; else one line naming it."""
    try:
        folder.expanduser().mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder.expanduser()):
            pass
    except OSError as e:
        raise ConfigError(
            f"{what} {folder} cannot be created or written ({e.strerror or e}): "
            "pick a folder this user can write"
        ) from e
