"""Apply TP/SP -> CP -> activation checkpointing -> per-block compile -> FSDP2 to a Llama
Transformer, and initialize the parallelized (meta-built) model exactly like a single-process run.

Order matters: TP first (it turns weights into DTensors on the TP mesh), CP swaps the attention
kernel before AC and compile wrap the blocks (selective 'op' AC inside the compiled block, whole-
block AC around it: see apply_ac), FSDP last so it shards the TP DTensors over the data-parallel
(x CP) mesh (torchtitan order).
"""

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titanlite.float8 import tp_styles
from titanlite.loss import cross_entropy_sum
from titanlite.models.decoder.context_parallel import cp_attention, split_inputs
from titanlite.models.decoder.tp_loss import tp_linear_cross_entropy_sum
from titanlite.models.tiled_init import fill_
from titanlite.parallel_dims import ParallelDims
from titanlite.torch_compat import (
    checkpoint_wrapper,
    local_shape_and_offset,
    selective_ac_saved_ops,
)

# Wrapper prefixes that checkpoint_wrapper / torch.compile insert into parameter names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def parallelize_decoder(
    model: nn.Module,
    parallel_dims: ParallelDims,
    *,
    parallelism_cfg,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    ac_cfg,
    compile_cfg,
    cpu_offload: bool = False,
) -> nn.Module:
    """Transform `model` in place (blocks may be replaced by wrappers) and return it.

    param_dtype / reduce_dtype are FSDP's compute and gradient-reduction dtypes, already resolved
    (titanlite.precision.resolve_param_dtype for "auto"). With `cpu_offload` the caller must
    materialize the parameters on the CPU (FSDP keeps the shards there).
    """
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.tp_mesh, parallel_dims.loss_parallel(parallelism_cfg))
    if parallel_dims.cp_enabled:
        apply_cp(model, parallel_dims.cp_mesh)
    # The 'op' policy goes inside the compiled blocks, whole-block AC outside them (apply_ac).
    ac_inside = ac_cfg.mode == "selective" and ac_cfg.selective_ac_option in _OP_POLICIES
    if ac_inside:
        apply_ac(model, ac_cfg.mode, ac_cfg.selective_ac_option)
    if compile_cfg.enable:
        compile_loss = not parallel_dims.loss_parallel(parallelism_cfg)
        apply_compile(model, compile_cfg.backend, compile_loss)
    if ac_cfg.mode != "none" and not ac_inside:
        apply_ac(model, ac_cfg.mode, ac_cfg.selective_ac_option)
    # FSDP's policy is the only mixed-precision mechanism, in every layout: autocast keeps the
    # residual stream in fp32 and rounds differently (one process under it was 1.5e-4 off FSDP 4
    # after four bf16 steps of the debug model). Without data parallelism FSDP runs over a
    # one-rank mesh, where it only casts (and, with cpu_offload, offloads: one GPU holding a
    # model whose weights and AdamW state do not fit in its memory).
    mixed_precision = param_dtype != torch.float32 or reduce_dtype != torch.float32
    if parallel_dims.fsdp_enabled or mixed_precision or cpu_offload:
        apply_fsdp(
            model,
            parallel_dims.fsdp_mesh,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=parallelism_cfg.fsdp_reshard_after_forward,
            cpu_offload=cpu_offload,
            pipelined=parallel_dims.pp_enabled,
        )
    return model


# Parameter-name suffixes that apply_tp splits (the memory estimator's count of them).
TP_SPLIT = (
    "wq.weight", "wk.weight", "wv.weight", "wo.weight", "w1.weight", "w2.weight", "w3.weight",
    "tok_embeddings.weight", "output.weight",
)  # fmt: skip


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, shard_logits: bool) -> None:
    """Megatron TP with sequence parallelism on the norms.

    The residual stream stays a DTensor (use_local_output=False on tok_embeddings / wo / w2):
    with plain local outputs, compiled blocks silently lose the embedding gradient under FSDP x TP
    (AOTAutograd drops it). rope_cache reaches the blocks as a plain tensor and is only used
    after the PrepareModuleInput all-gather, i.e. on the full sequence, so it needs no layout.
    """
    # Loss parallel keeps the logits vocab-sharded; else gather them for a plain CE.
    logits = Shard(-1) if shard_logits else Replicate()
    root_plan = {
        # An embedding's rowwise split is by vocab: Shard(0), as the output's colwise one.
        "tok_embeddings": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        ),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=logits, use_local_output=not shard_logits
        ),
    }
    if model.args.tie_embeddings:
        # The tied output reads the embedding's weight, vocab-sharded above: the same DTensor
        # serves the matmul on all-gathered hidden states, giving vocab-sharded logits, and
        # both uses' gradients accumulate into its one gradient.
        root_plan["output"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
            output_layouts=(Shard(-1),), desired_output_layouts=(logits,),
            use_local_output=not shard_logits,
        )  # fmt: skip
    # A pipeline stage lacks the embedding or the head: plan only what it has.
    root_plan = {name: style for name, style in root_plan.items() if getattr(model, name)}
    parallelize_module(model, tp_mesh, root_plan)
    model.chunked_loss = tp_linear_cross_entropy_sum  # the output weight is now vocab-sharded
    # Tensorwise float8 blocks all-gather their activations in float8 (titanlite/float8.py).
    colwise, rowwise, prepare_input = tp_styles(model.layers, tp_mesh)
    block_plan = {
        "attention_norm": SequenceParallel(),
        # (x, rope_cache, document mask or None): only x is a sequence-parallel activation.
        "attention": prepare_input(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": colwise(),
        "attention.wk": colwise(),
        "attention.wv": colwise(),
        "attention.wo": rowwise(output_layouts=Shard(1), use_local_output=False),
        "ffn_norm": SequenceParallel(),
        "feed_forward": prepare_input(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": colwise(),
        "feed_forward.w2": rowwise(output_layouts=Shard(1), use_local_output=False),
        "feed_forward.w3": colwise(),
    }
    if any(block.attention.q_norm is not None for block in model.layers.values()):
        # QK-norm: q and k arrive as this rank's heads [b, s, h/tp, hd], sharded on dim 2; the
        # norms' weights are replicated, so their gradients are summed over the TP group.
        for norm in ("attention.q_norm", "attention.k_norm"):
            block_plan[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Context parallelism (context_parallel.py): the model is given this rank's two chunks of
    every sequence (tokens, labels, positions), and each block attends over K and V gathered
    from the CP group. The caller counts the step's target tokens before the split."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    model.register_forward_pre_hook(partial(split_inputs, cp=cp, rank=rank), with_kwargs=True)
    attend = partial(cp_attention, group=cp_mesh.get_group(), cp=cp, rank=rank)
    for block in model.layers.values():
        block.attention.attend = attend


# Ops whose outputs selective AC keeps: matmuls (expensive to recompute, cheap to store relative
# to the elementwise tails), attention (SDPA dispatches to a different op per device) and TP's
# reduce-scatter; the list names private aten ops, so it lives in torch_compat.
_SAC_SAVE = selective_ac_saved_ops()


def _sac_policy(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func in _SAC_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _sac_context():
    return create_selective_checkpoint_contexts(_sac_policy)


def _alternate_mm_sac_context():
    """'op_alternate' (torchtitan's 'op'): as 'op', but every second matmul of a block is
    recomputed (k, wo's and w3's outputs), so a block keeps 4 of its 7 matmul outputs (8B:
    31,744 instead of 51,200 elements per token) and recomputes about a third of its forward
    matmul FLOPs."""
    # torch <= 2.12 asks the policy again in the recompute (2.13 replays the forward's
    # decisions): with a count of its own the recompute picks the forward's matmuls.
    counts = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs):
        if func is torch.ops.aten.mm.default:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return _sac_policy(ctx, func, *args, **kwargs)

    return create_selective_checkpoint_contexts(policy)


_OP_POLICIES = {"op": _sac_context, "op_alternate": _alternate_mm_sac_context}


def apply_ac(model: nn.Module, mode: str, selective_option: str = "op") -> None:
    """full: recompute every block; selective 'op': keep matmul/attention outputs ('op_alternate':
    every second matmul's); selective 'N': full AC on every Nth block (blocks N-1, 2N-1, ...).
    The options are checked by the config.

    Under compile the 'op' policy must wrap the block inside the compiled region (it tags the ops
    dynamo traces), and whole-block AC must wrap the compiled block, re-running it in backward:
    compiled, whole-block AC replays SDPA (an RNG op) in the backward graph, and on CPU torch
    2.13 then saves the RNG state after the saved opaque objects; under TP (a DeviceMesh is
    saved) AOTAutograd fails with "expected all tensors_saved_with_vc_check to be Tensors".
    """
    every = 1
    kwargs = {}
    if mode == "selective" and selective_option in _OP_POLICIES:
        kwargs["context_fn"] = _OP_POLICIES[selective_option]
    elif mode == "selective":
        every = int(selective_option)
    for key, block in model.layers.items():
        if (int(key) + 1) % every == 0:
            # RNG state is not preserved: the blocks have no dropout, so saving it is pure cost.
            model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False, **kwargs)


def apply_compile(model: nn.Module, backend: str, compile_loss: bool = True) -> None:
    """Compile each block on its own: identical blocks share one compiled graph (fast warm-up),
    and FSDP's per-block hooks stay outside the compiled regions. With `compile_loss` the plain
    (unchunked) loss too: eager, it upcasts the [tokens, vocab] logits to fp32 and keeps their
    log-softmax and its gradient, 12 more bytes per logit; compiled, it reads the logits in one
    fused pass and writes only their gradient. Loss parallel's vocab-sharded DTensor logits
    stay eager (its loss runs under torch's loss_parallel context)."""
    for key, block in model.layers.items():
        model.layers[key] = torch.compile(block, backend=backend, fullgraph=True)
    if compile_loss:
        model.plain_loss = torch.compile(cross_entropy_sum, backend=backend)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str,
    cpu_offload: bool = False,
    pipelined: bool = False,
) -> None:
    """FSDP2 per block, then the root (embedding, final norm, output); 2-D mesh = HSDP.

    Gradients are SUMMED over data-parallel ranks: the trainer already divides the loss by the
    global token count, so FSDP's default averaging would divide twice. `cpu_offload`: sharded
    params, grads and AdamW state stay in (pinned, on a GPU) host memory; each unit's shards are
    copied to the device for its all-gather, and the optimizer steps on the CPU. `pipelined`:
    `model` is a pipeline stage, run forward once per pipeline microbatch before any backward.
    """
    no_offload = OffloadPolicy()  # fully_shard's default
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if cpu_offload else no_offload
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # Blocks must not cast their inputs: the rope cache must stay fp32 (it would reach them in
    # bf16). The residual stream is already in param_dtype, as the embedding's output.
    block_mp = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    keys = list(model.layers.keys())
    for key in keys:
        # 'default': the last block would be all-gathered again right away for backward. A
        # pipeline stage keeps every block: resharded, each would be all-gathered again in the
        # forward and the backward of every pipeline microbatch.
        reshard = reshard_after_forward == "always" or (
            reshard_after_forward == "default" and key != keys[-1] and not pipelined
        )
        fully_shard(
            model.layers[key], mesh=mesh, mp_policy=block_mp, reshard_after_forward=reshard,
            offload_policy=offload,
        )  # fmt: skip
    # The root keeps FSDP's root default (no reshard): its params are needed first in backward.
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    # On one rank FSDP already sums (it reduces nothing); a divide factor there, even 1, makes it
    # divide each block's whole gradient into a new buffer and copy that (torch's one-rank path):
    # 2-3% of a bf16 step of the debug model on a CPU.
    if mesh.size() > 1:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                _set_sum_reduction(module)


def _set_sum_reduction(module: FSDPModule) -> None:
    # Both setters are per module (not recursive). A divide factor of 1 alone makes FSDP use
    # PREMUL_SUM, which gloo rejects; force-sum makes it a plain SUM on every backend.
    module.set_gradient_divide_factor(1.0)
    if hasattr(module, "set_force_sum_reduction_for_comms"):
        module.set_force_sum_reduction_for_comms(True)
    elif torch.distributed.get_backend() != "nccl":
        raise RuntimeError(
            "this torch has no FSDPModule.set_force_sum_reduction_for_comms, and gloo cannot "
            "run the PREMUL_SUM reduction a divide factor of 1 needs; upgrade torch or use nccl"
        )


def _clean_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@torch.no_grad()
def init_weights_parallel(model: nn.Module, seed: int, device) -> None:
    """Give `model` (plain, TP, FSDP or both, after to_empty) exactly the weights of
    `Transformer(args).init_weights(seed)` in one process on this device type, for any layout.

    Each rank draws only the tiles that cover its own shards (titanlite.models.tiled_init), on
    the device: the cost per rank follows its shard, not the model. Shards kept on the CPU (FSDP
    CPU offload) are drawn on the device too, then copied: CPU and CUDA generators differ.
    """
    for name, param in model.named_parameters():
        key, local, offset = _clean_name(name), param, None
        if isinstance(param, DTensor):
            local = param.to_local()
            shape, offset = local_shape_and_offset(param.shape, param.device_mesh, param.placements)
            assert tuple(local.shape) == tuple(shape), (key, local.shape, shape)
        on_device = local.device == torch.device(device)
        drawn = local if on_device else torch.empty_like(local, device=device)
        fill_(drawn, model.param_init(key), seed=seed, key=key, global_shape=param.shape,
              offset=offset)  # fmt: skip
        if not on_device:
            local.copy_(drawn)
    model.init_buffers(device)
