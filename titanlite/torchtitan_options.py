"""torchtitan's options (v0.2.2's JobConfig) that titanlite does not have, each with the reason
and what to use instead: a torchtitan config or command line that names one stops with that,
not with "unknown option". A name in no table here and not in JobConfig is a typo.

`python -m titanlite.torchtitan_options --markdown` prints the table of docs/torchtitan.md.
"""

import sys

_NO_MOE = "titanlite has dense Llama models only (no mixture of experts)"
_TORCHFT = (
    "TorchFT fault tolerance is not part of titanlite, which recovers by checkpoint and restart "
    "(torchrun --max-restarts, SLURM requeue)"
)
_NO_VAL_WORKERS = (
    "validation reads in the training process (short, infrequent passes); worker processes "
    "are for training: training.dataloader.*"
)
_MX = (
    "MX formats (MXFP8, Blackwell GPUs, torchao prototype) are not supported; "
    "float8 linears are: quantize.linear.float8.*"
)

# torchtitan v0.2.2 options that titanlite lacked once and has now (their help says what they do).
ADDED = (
    "checkpoint.enable_first_step_checkpoint",
    "comm.init_timeout_seconds",
    "comm.train_timeout_seconds",
    "debug.deterministic_warn_only",
    "parallelism.pipeline_parallel_schedule_csv",
    "training.gc_freq",
)

# Out of scope here, for the reason given.
NOT_IN_TITANLITE = {
    "job.custom_config_module": "the config schema is fixed and validated (titanlite/config.py); "
    "a new section is a dataclass there",
    "experimental.custom_args_module": "the config schema is fixed (torchtitan deprecated this "
    "option too)",
    "metrics.disable_color_printing": "titanlite's console lines carry no colors",
    "parallelism.module_fqns_per_model_part": "stages are cut by whole layers: "
    "parallelism.pipeline_parallel_layers_per_stage, parallelism.pipeline_parallel_first_stage_"
    "less_layers, parallelism.pipeline_parallel_last_stage_less_layers",
    "parallelism.pipeline_parallel_expert_parallel_overlap": _NO_MOE,
    "parallelism.context_parallel_load_balancer": "context parallelism always balances causal "
    "work by the head-tail split (torchtitan's default, 'headtail')",
    "parallelism.expert_parallel_degree": _NO_MOE,
    "parallelism.expert_tensor_parallel_degree": _NO_MOE
    + "; dense layers use parallelism.tensor_parallel_degree",
    "parallelism.expert_parallel_comm_backend": _NO_MOE,
    "checkpoint.enable_ft_dataloader_checkpoints": _TORCHFT
    + "; every checkpoint holds the data position",
    "checkpoint.initial_load_in_hf_quantized": "Hugging Face weights are read in bf16 or fp32; "
    "dequantize a quantized checkpoint first",
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": _NO_MOE
    + " (it forces an MoE router's matmul to be recomputed)",
    "activation_checkpoint.preserve_rng_state": "the blocks draw no random numbers (no dropout), "
    "so no RNG state is saved for recomputation",
    "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": _MX,
    "quantize.linear.mx.recipe_name": _MX,
    "quantize.linear.mx.filter_fqns": _MX,
    "quantize.grouped_mm.float8.fqns": _NO_MOE + " (grouped GEMMs are MoE experts')",
    "quantize.grouped_mm.mx.recipe_name": _NO_MOE + " (grouped GEMMs are MoE experts')",
    "quantize.grouped_mm.mx.fqns": _NO_MOE + " (grouped GEMMs are MoE experts')",
    "memory_estimation.enable": "use scripts/estimate_memory.py, or the dry run "
    "(--comm.mode fake_backend), which reports each rank's estimated peak",
    "memory_estimation.disable_fake_mode": "use scripts/estimate_memory.py",
    "fault_tolerance.enable": _TORCHFT,
    "fault_tolerance.process_group": _TORCHFT,
    "fault_tolerance.process_group_timeout_ms": _TORCHFT,
    "fault_tolerance.replica_id": _TORCHFT,
    "fault_tolerance.group_size": _TORCHFT
    + "; replicated groups are parallelism.data_parallel_replicate_degree (HSDP)",
    "fault_tolerance.min_replica_size": _TORCHFT,
    "fault_tolerance.semi_sync_method": _TORCHFT,
    "validation.dataset": "validation reads validation.dataset_path, else a held-out share of "
    "the training data (validation.holdout_fraction)",
    "validation.dataloader.num_workers": _NO_VAL_WORKERS,
    "validation.dataloader.persistent_workers": _NO_VAL_WORKERS,
    "validation.dataloader.pin_memory": "batches are pinned before the copy to a GPU already",
    "validation.dataloader.prefetch_factor": _NO_VAL_WORKERS,
    "debug.moe_force_load_balance": _NO_MOE,
}

# Meaningful here, not built yet: what to do meanwhile.
NOT_YET = {
    "job.save_config_file": "the resolved config is always written to "
    "{job.dump_folder}/config.toml",
    "profiling.profiler_active": "one step is traced every profiling.profile_freq steps",
    "profiling.profiler_warmup": "one warm-up step precedes each traced step",
    "model.hf_assets_path": "set model.tokenizer_path to the folder's tokenizer.model and "
    "checkpoint.initial_load_path (with checkpoint.initial_load_in_hf) to its weights",
    "model.print_after_conversion": "the model is logged before conversion only",
    "lr_scheduler.total_steps": "the schedule spans training.steps",
    "training.dtype": "parameters stay fp32; compute dtype is training.mixed_precision_param",
    "training.gc_debug": "use training.gc_freq 1 to collect every step",
    "parallelism.enable_async_tensor_parallel": "tensor parallelism runs its collectives "
    "synchronously",
    "checkpoint.load_only": "set checkpoint.interval beyond training.steps",
    "activation_checkpoint.early_stop": "torch's default (stop recomputing early) applies",
    "activation_checkpoint.memory_budget": "choose activation_checkpoint.mode full, selective "
    "or none",
    "activation_checkpoint.visualize_memory_budget_pareto": "see activation_checkpoint."
    "memory_budget",
    "activation_checkpoint.determinism_check": "torch's default check applies",
    "activation_checkpoint.debug": "torch's default applies",
    "compile.components": "compile.enable compiles each transformer block and the plain "
    "(unchunked) loss, as torchtitan's default ['model', 'loss'] does; no choice per component",
    "comm.trace_buf_size": "set TORCH_FR_BUFFER_SIZE in the environment (NCCL's flight recorder)",
    "comm.save_traces_folder": "set TORCH_FR_DUMP_TEMP_FILE in the environment",
    "comm.save_traces_file_prefix": "set TORCH_FR_DUMP_TEMP_FILE in the environment",
    "experimental.custom_import": "import your module from a launcher script that calls "
    "train.main(); a model family registers itself in titanlite/models/__init__.py",
    "validation.seq_len": "validation runs at training.seq_len",
}


def explain(name: str) -> str | None:
    """'a torchtitan option titanlite does not have: <why>' for such an option, else None."""
    if name in NOT_IN_TITANLITE:
        return f"a torchtitan option titanlite does not have: {NOT_IN_TITANLITE[name]}"
    if name in NOT_YET:
        return f"a torchtitan option titanlite does not have yet: {NOT_YET[name]}"
    return None


def markdown_table() -> str:
    """The Markdown table of every torchtitan v0.2.2 option titanlite lacked, one row each."""
    from titanlite.config_parse import OPTIONS  # here: config_parse imports this module

    rows = {name: f"implemented. {OPTIONS[name].metadata['help']}" for name in ADDED}
    rows |= {name: f"not here: {why}" for name, why in NOT_IN_TITANLITE.items()}
    rows |= {name: f"not yet: {why}" for name, why in NOT_YET.items()}
    lines = ["| torchtitan option | in titanlite |", "|---|---|"]
    lines += [f"| `{name}` | {rows[name]} |" for name in sorted(rows)]
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m titanlite.torchtitan_options --markdown")
    print(markdown_table())
