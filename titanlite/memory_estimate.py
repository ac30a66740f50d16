"""Per-rank peak memory of a titanlite training step, estimated without a GPU.

peak = params + optimizer states                              (persistent, sharded)
     + max(start of backward, optimizer step)                  (live)
     + what the caching allocator keeps of the other one       (CUDA only)

start of backward = gradients held from earlier microbatches (none without accumulation)
                    + FSDP's unsharded buffers + activations + the loss
optimizer step    = all the sharded gradients + the step's temporaries

On CUDA this is what the caching allocator reserves at its peak, the figure train.py logs as
`memory_gib` (peak reserved; `memory_active_gib` beside it is the live part), so the two compare
directly. The GPU holds more than that, outside the allocator and not estimated: the CUDA
context (driver state and loaded kernels) and NCCL's communication buffers, both allocated
outside torch's allocator, so nvidia-smi counts them and torch's statistics do not. Neither has
been measured here; leave room for them below the GPU's capacity. cuBLAS's workspace (32 MiB per
stream on Hopper, 8.1 MiB on older GPUs: PyTorch's CublasHandlePool.cpp) comes from the
allocator and is small enough to leave out.

Assumptions (each one is a place the estimate can be wrong; docs/performance.md has the measured
error):
- Parameters are counted on the meta-built model (its family from the model hook), so the count
  is exact. Master weights, grads and the two AdamW states are fp32. FSDP shards every
  parameter 1/(dp_shard x cp) (dim-0 padding ignored); replication (HSDP) does not shard. TP
  splits the block linears, the embedding and the output projection 1/tp; the RMSNorm weights
  stay replicated.
- Gradients: train.py zeroes them with set_to_none, so a step's first backward starts with none
  sharded; each appears as its block's backward frees that block's activations, so the
  working set shrinks from the start of backward on (or, where a block's gradient outweighs its
  activations, the optimizer step is the peak). With gradient accumulation a later
  microbatch's backward starts with all of them.
- FSDP keeps the root's unsharded param_dtype weights (embedding, final norm, output) for the
  whole step, and 2 blocks' unsharded weights in flight (current + prefetched) plus one block's
  unsharded fp32 gradient waiting for its reduce-scatter (under PP: see below).
- Without data parallelism FSDP still wraps the model when the compute dtype is not fp32 (its
  policy is the only mixed-precision mechanism), over a one-rank mesh: the same buffers as above.
- Activations per block and token follow this repo's model.py (eager, no fusion): saved tensors of
  8 x dim + 4 x ffn_dim elements (norm inputs and outputs x2, q after RoPE, k and v, SDPA's
  output, which wo's input views (a copy under CP), w1/w3 outputs, silu output, the gated product;
  SDPA keeps k and v with their kv heads, 2 x kv_dim, or repeated to the query heads, 2 x dim, on
  CPU and where a dense document mask makes attention repeat them), plus fp32 scalars: each norm's
  rstd and SDPA's logsumexp per head (on CPU too: model.RMSNorm keeps what CUDA's fused kernel
  does, not the fp32 copies of torch's composite). RoPE's rotation, [seq, head_dim / 2]
  complex per block and microbatch whatever the batch, is left out (under 1%). Under TP with
  sequence parallel everything but the two all-gathered norm outputs is divided by tp (all of it
  measured to the byte on CPU, bf16 and fp32, TP 1 and 2, and CP 2). Under CP a rank holds seq_len
  / cp tokens of each sequence, and attention saves the K and V gathered over the whole sequence
  instead of the local ones: 2 x kv_dim x cp per local token, or under GQA the copies that the
  early and the late chunk's masked calls repeat to the query heads, 2 x dim x (cp + 1/2).
  Selective 'op' AC keeps the matmul and SDPA outputs and the block input (CP's K/V are gathered
  again in backward); full AC keeps the block input; selective 'N' makes every Nth block full
  AC. With AC one block's full activations are rebuilt in backward. Eager, a block's backward
  peaks in its FFN, holding two [tokens, ffn] gradients beside the block's saved tensors (torch's
  MemTracker on CPU, no AC and full AC: the saved set + 2 x ffn, to the MiB); compiled, none
  (the fused backward frees saved tensors as it makes their gradients).
- Masks: SDPA turns a bool mask into an additive bias in the activation dtype, which its kernel
  keeps for backward (CPU's flash, CUDA's memory-efficient and cuDNN kernels all take the bias in
  their backward). A block holds, per microbatch, [rows, seq, seq] for a dense document mask (the
  sdpa backend), and under CP [c, (r + 1) c] and [c, (2 cp - r) c] for its two causal chunks (c =
  seq / 2 cp; rows x those with a document mask): every block that keeps its saved tensors, and
  the block AC rebuilds (selective 'op' recomputes them). The dense document mask itself,
  [rows, seq / cp, seq] bools, is built once a forward and kept per microbatch in flight; CP's
  causal chunk masks, bools too, one SDPA call at a time; flex's block mask is small and not
  counted.
- Loss: unchunked, the fp32 logits exist three times at the start of backward (saved
  log-softmax, its incoming and its outgoing gradient) plus the param_dtype logits (compiled:
  only the param_dtype logits and their gradient); chunked, one chunk's logits (fp32 +
  param_dtype copy), the fp32 [tokens, dim] input gradient and the [vocab, dim] weight gradient
  in the weight's dtype. Loss parallel divides the vocab by tp.
- torch.compile (compile.enable) compiles each block: inductor keeps each norm's rstd instead of
  its input, recomputes silu from w1's output and drops w2's output (block_activation_elems);
  it also compiles the plain loss (loss_bytes).
- The foreach AdamW step allocates about one fp32 copy of the local parameters as temporaries.
- Optimizer states (optimizer.name's recipe; optimizer.groups rules are not modeled): AdamW and
  Adam keep two fp32 moments per parameter (AdamW bf16 ones with optimizer.state_dtype
  bfloat16, whose step computes in fp32 one parameter at a time); Muon one fp32 momentum
  buffer per element of the hidden matrices (the block linears) and AdamW's two moments for
  the rest. Muon's step holds,
  beside AdamW's temporaries for the rest, one whole matrix at a time (the largest counted):
  its gathered fp32 update, Newton-Schulz's bf16 iterate, product and result, the bf16 result
  the owner broadcasts, and two bf16 square Gram matrices of its shorter side (titanlite/optim/
  muon.py): 12 N + 4 m^2 bytes for an n x m matrix of N elements, m <= n.
- CUDA's caching allocator keeps what a step frees: the working set of the smaller peak is
  reused by the larger one only in part (CUDA_CACHED_FRACTION of it is added).
- CPU offload (FSDP's CPUOffloadPolicy): the sharded params, grads, AdamW states and the step's
  temporaries live in host memory, none of it on the device; FSDP applies, as with bf16. The
  device copies of one unit's shards before its all-gather (1/dp_shard of the unit) are left
  out.
- Pipeline parallelism: pipeline rank r holds its stages' blocks (the split of pipeline.py), the
  embedding on the first stage and the final norm + output on the last. Activations are kept
  for the pipeline microbatches in flight, each of pipeline_parallel_microbatch_size rows:
  GPipe all of them; 1F1B min(n, pp - r); multi-stage schedules (v stages a rank) count stage
  forwards in flight, min(n v, (v - 1) pp + 2 (pp - 1 - r) + 1), torch's interleaved warm-up,
  each of one stage's blocks (zero-bubble and V schedules are taken to hold the same). The
  logits exist for one pipeline microbatch at a time. FSDP keeps every block of a stage
  unsharded (fsdp_reshard_after_forward default under PP). torch's pipeline stage turns FSDP's
  gradient sync off for every microbatch's backward and reduce-scatters once after the last,
  so the stage's unsharded gradients (its blocks and root parts) accumulate in fp32 (FSDP's
  reduce dtype) from the first backward to the end of the step, beside the param_dtype
  gradients not yet upcast (fsdp_grad_bytes): at 405B on TP 8 x PP 8, 24 GiB a rank. The
  received activations and the gradients sent back are not counted separately.
"""

from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

from titanlite.config import SELECTIVE_OP_OPTIONS, valid_selective_ac_option
from titanlite.models import get_family
from titanlite.models.pipeline_plan import SINGLE_STAGE, plan_pipeline

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# What torch's caching allocator keeps reserved beyond the live peak. The optimizer step frees
# the step's gradients and its temporaries (set_to_none), blocks shaped like the parameters,
# and the next forward and backward reuse them only in part (and the other way round): on 11
# single-GPU runs on an H200 (1B to 70B block shapes, 4K to 64K tokens, train.py's default
# expandable segments) reserved exceeded the live peak by 0.30-0.85 of the smaller of the two
# working sets, median 0.7.
CUDA_CACHED_FRACTION = 0.7
CACHE_ROW = "allocator cache (freed, kept)"


@dataclass(frozen=True)
class MemorySetup:
    """Everything that decides one rank's memory; degrees already resolved (no -1)."""

    model_args: object  # the family's args
    local_batch_size: int
    seq_len: int
    model_name: str = "llama3"  # model.name: the family whose model is counted
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    ac_mode: str = "none"  # none | full | selective
    selective_ac_option: str = "op"  # "op", "op_alternate" or N (every Nth block)
    chunk_tokens: int = 0
    param_dtype: str = "bfloat16"
    loss_parallel: bool = False
    reshard_after_forward: str = "default"
    cpu_offload: bool = False  # training.enable_cpu_offload
    compiled_loss: bool = False  # compile.enable without loss parallel: the plain loss compiled
    compiled: bool = False  # compile.enable: the blocks compiled (inductor saves less)
    accumulation: int = 1  # microbatches per optimizer step (gradient accumulation)
    pp: int = 1
    pp_rank: int = 0  # the pipeline rank whose memory is estimated
    pp_options: object = None  # the parallelism config section (pipeline_parallel_*), with pp > 1
    device: str = "cuda"  # "cpu": no allocator cache
    optimizer: str = "AdamW"  # optimizer.name: AdamW, Adam, or Muon (its recipe)
    state_dtype: str = "float32"  # optimizer.state_dtype: AdamW's moments

    def __post_init__(self):
        if self.ac_mode not in ("none", "full", "selective"):
            raise ValueError(f"ac_mode must be none|full|selective, got {self.ac_mode!r}")
        opt = self.selective_ac_option
        if self.ac_mode == "selective" and not valid_selective_ac_option(opt):
            raise ValueError(
                f"selective_ac_option must be 'op', 'op_alternate' or a positive int, got {opt!r}"
            )
        if self.param_dtype not in DTYPE_BYTES:
            raise ValueError(f"param_dtype must be one of {sorted(DTYPE_BYTES)}")
        positive = "dp_replicate dp_shard tp cp pp local_batch_size seq_len accumulation"
        for name in positive.split():
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def fsdp(self) -> bool:
        # parallelize_decoder applies FSDP with data or context parallelism, a compute dtype
        # below fp32, or CPU offload.
        sharded = self.dp_shard * self.cp > 1 or self.dp_replicate > 1
        return sharded or self.param_dtype != "float32" or self.cpu_offload

    @property
    def local_tokens(self) -> int:
        """Tokens of one (pipeline) microbatch on this rank: CP ranks hold 1/cp of each
        sequence."""
        return self.share.rows * self.seq_len // self.cp

    @cached_property
    def share(self) -> "RankShare":
        """What this rank holds and runs: all of the model, or its pipeline stages. Cached (the
        setup is frozen): one estimate reads it 17 times, and a plan weighs ~100,000 setups."""
        a = self.model_args
        if self.pp == 1:
            return RankShare(a.n_layers, True, True, 1.0, self.local_batch_size)
        p = self.pp_options
        plan = plan_pipeline(a.n_layers, self.pp, self.local_batch_size, p)
        ids = plan.stage_ids(self.pp_rank, self.pp)
        blocks = sum(len(plan.stage_layers[i]) for i in ids)
        n, v, r = plan.microbatches, plan.stages_per_rank, self.pp_rank
        if plan.schedule == "GPipe":
            in_flight = n
        elif plan.schedule in SINGLE_STAGE:
            in_flight = min(n, self.pp - r)
        else:  # stage forwards of 1/v of the rank's blocks each
            in_flight = min(n * v, (v - 1) * self.pp + 2 * (self.pp - 1 - r) + 1) / v
        last = plan.num_stages - 1
        return RankShare(
            blocks, 0 in ids, last in ids, in_flight, p.pipeline_parallel_microbatch_size
        )


@dataclass(frozen=True)
class RankShare:
    blocks: int  # transformer blocks held
    embedding: bool
    head: bool  # final norm, output and loss
    in_flight: float  # microbatches whose activations of all `blocks` are kept at the peak
    rows: int  # rows per (pipeline) microbatch


@dataclass
class MemoryEstimate:
    """Bytes per rank, by component, in the order printed."""

    rows: dict[str, float] = field(default_factory=dict)
    num_params: int = 0
    peak: str = ""  # the phase of the step the rows add up at

    @property
    def total(self) -> float:
        return sum(self.rows.values())

    def table(self) -> str:
        lines = [f"{'component':<34} {'GiB':>9}", "-" * 44]
        lines += [f"{name:<34} {b / GIB:>9.3f}" for name, b in self.rows.items()]
        lines += ["-" * 44, f"{'total (estimated peak per rank)':<34} {self.total / GIB:>9.3f}"]
        if self.peak:
            lines.append(f"(the peak: {self.peak})")
        return "\n".join(lines)


_ROOT_PARTS = {"tok_embeddings": "embedding", "output": "output", "norm": "norm"}


def param_counts(args, model_name: str = "llama3") -> dict[str, int]:
    """Element counts of the meta-built model: 'embedding', 'output', 'norm' (the final one),
    and of one block 'block_split' (what TP splits) and 'block_replicated' (its norms); 'total'."""
    family = get_family(model_name)
    with torch.device("meta"):
        model = family.model_cls(args)
    counts = dict.fromkeys(("embedding", "output", "norm", "block_split", "block_replicated"), 0)
    for name, p in model.named_parameters():
        if name.startswith("layers.0."):
            counts["block_split" if name.endswith(family.tp_split) else "block_replicated"] += (
                p.numel()
            )
        elif not name.startswith("layers."):
            counts[_ROOT_PARTS[name.split(".")[0]]] += p.numel()
    counts["total"] = sum(p.numel() for p in model.parameters())
    largest = max(
        (p for name, p in model.named_parameters() if name.startswith("layers.0.") and p.ndim == 2),
        key=lambda p: p.numel(),
    )
    counts["largest_matrix"], counts["largest_matrix_short"] = largest.numel(), min(largest.shape)
    return counts


def _held(counts: dict[str, int], s: MemorySetup, blocks: int) -> float:
    """Elements of `blocks` blocks and the root parts this rank holds, after TP."""
    embedding, head = _root_held(counts, s)
    return blocks * _block_held(counts, s) + embedding + head


def _block_held(counts: dict[str, int], s: MemorySetup) -> float:
    """Elements of one block after TP."""
    return counts["block_split"] / s.tp + counts["block_replicated"]


def _root_held(counts: dict[str, int], s: MemorySetup) -> tuple[float, float]:
    """Elements of the (embedding, final norm + output) this rank holds after TP: 0 for a part
    on another pipeline stage. A tied output has no weight of its own, but a last stage without
    the embedding holds a copy of it."""
    output = counts["output"]
    if s.model_args.tie_embeddings and not s.share.embedding:
        output = counts["embedding"]
    embedding = counts["embedding"] / s.tp if s.share.embedding else 0.0
    head = output / s.tp + counts["norm"] if s.share.head else 0.0
    return embedding, head


def _local_params(counts: dict[str, int], s: MemorySetup) -> float:
    """Elements of the parameters this rank owns after TP then FSDP sharding."""
    return _held(counts, s, s.share.blocks) / (s.dp_shard * s.cp)


def block_activation_elems(s: MemorySetup) -> tuple[float, float, float]:
    """Per token, elements one block saves for backward: (no AC, selective op, full AC)."""
    a, tp = s.model_args, s.tp
    dim, ffn, kv = a.dim, a.ffn_hidden_dim, a.num_kv_heads * a.head_dim
    q = a.n_heads * a.head_dim  # the attention's width: dim, unless the family sets head_dim
    fp32 = 4 / DTYPE_BYTES[s.param_dtype]  # an fp32 element, in elements of the compute dtype
    # SP: norm inputs/outputs are sequence-sharded; their all-gathered copies (the linears'
    # saved inputs) are whole; everything inside attention/FFN is head/column-sharded.
    # attention_norm's and ffn_norm's inputs (the residual stream) and fp32 rstd.
    norm_io = 2 * (dim + fp32) / tp
    gathered = 2 * dim  # norm outputs as the column-parallel linears save them
    # SDPA's k and v (kernels.sdpa): the kv heads, or repeated to the query heads for a mask (CP's
    # chunks, a dense document mask) and on CPU. Under CP the whole sequence's, gathered: one
    # copy, or the chunks' repeated keys, (2 cp + 1) / 2 per local token.
    dense_mask = a.document_masking and a.attention_backend == "sdpa"
    repeats = s.cp > 1 or dense_mask or s.device == "cpu"
    repeated = 2 * q * (s.cp + 0.5 if s.cp > 1 else 1)
    sdpa_kv = repeated if repeats and kv < q else 2 * kv * s.cp
    # q, k, v, SDPA's output and its fp32 logsumexp, wo's input; w1, silu, w3, prod. wo's
    # input is a view of SDPA's output, which the kernels write [b, s, h, hd], but a copy of
    # the two chunks' outputs that CP's attention concatenates [b, h, s, hd].
    outputs = 2 if s.cp > 1 else 1
    extra = get_family(s.model_name).extra_saved_per_token(a)
    inner = ((1 + outputs) * q + sdpa_kv + a.n_heads * fp32 + 4 * ffn + extra) / tp
    full = norm_io + gathered + inner
    # Selective op: block input + mm outputs (q, k, v before repeat, wo, w1, w3, w2) + sdpa out
    # (CP's gathered k and v are gathered again in backward, like TP's norm outputs);
    # 'op_alternate' recomputes every second matmul: k, wo and w3.
    mm_out = q + 2 * kv + dim + 2 * ffn + dim
    if s.selective_ac_option == "op_alternate":
        mm_out -= kv + dim + ffn
    sac = dim / tp + (mm_out + dim) / tp
    if s.compiled:
        # Inductor's partition of a compiled block keeps each norm's rstd instead of its input,
        # recomputes silu(w1 x) from w1's output, drops w2's output, which no gradient reads,
        # and keeps 3 x dim of attention besides k and v, one more than eager (a compiled 8B
        # block on CPU saved exactly these: tests/test_memory_estimate.py).
        full = gathered + (3 * dim + sdpa_kv + 3 * ffn) / tp
        sac -= dim / tp
    ckpt = dim / tp  # full AC: the block input only
    return full, sac, ckpt


def activation_bytes(s: MemorySetup) -> float:
    """Saved activations of this rank's blocks for every microbatch in flight, plus one block
    rebuilt by AC, plus (eager) the FFN's backward's gradients, plus the masks. Compiled, none:
    on an H200 (8B's blocks, full AC, 32K-128K tokens) the live peak was 2-6% above the
    estimate without them."""
    share = s.share
    n = share.blocks
    act = DTYPE_BYTES[s.param_dtype]
    full, sac, ckpt = (elems * act for elems in block_activation_elems(s))
    # kept: per token, what the blocks keep; masked: the blocks that keep SDPA's mask bias.
    if s.ac_mode == "none":
        kept, rebuilt, masked = n * full, 0.0, n
    elif s.ac_mode == "full":
        kept, rebuilt, masked = n * ckpt, full, 0
    elif s.selective_ac_option in SELECTIVE_OP_OPTIONS:
        kept, rebuilt, masked = n * sac, full - sac, 0
    else:
        n_ckpt = n // int(s.selective_ac_option)
        kept, rebuilt, masked = n_ckpt * ckpt + (n - n_ckpt) * full, full, n - n_ckpt
    grad_buffers = 0.0 if s.compiled else 2 * s.model_args.ffn_hidden_dim / s.tp * act
    tokens = s.local_tokens * (kept * share.in_flight + rebuilt + grad_buffers)
    biases = (masked * share.in_flight + (s.ac_mode != "none")) * mask_bias_bytes(s)
    return tokens + biases + bool_mask_bytes(s)


def mask_bias_bytes(s: MemorySetup) -> float:
    """The additive mask one block's attention keeps per microbatch (the module docstring)."""
    a, seq, cp, act = s.model_args, s.seq_len, s.cp, DTYPE_BYTES[s.param_dtype]
    if a.document_masking and a.attention_backend == "flex":
        return 0.0  # flex takes its block mask as it is
    rows = s.share.rows if a.document_masking else 1  # a causal mask is broadcast over rows
    pairs = (seq // (2 * cp)) ** 2 * (2 * cp + 1) if cp > 1 else seq * seq  # query x key
    return rows * pairs * act if cp > 1 or a.document_masking else 0.0


def bool_mask_bytes(s: MemorySetup) -> float:
    """The bool masks: the sdpa backend's dense document masks, [rows, seq / cp, seq] per
    microbatch in flight, else under CP the causal chunk mask of one SDPA call (the largest,
    [seq / (2 cp), seq]), made per call before its bias."""
    a, seq, cp = s.model_args, s.seq_len, s.cp
    if a.document_masking and a.attention_backend == "sdpa":
        return s.share.rows * seq // cp * seq * s.share.in_flight
    return 0.0 if cp == 1 or a.document_masking else seq // (2 * cp) * seq


def loss_bytes(s: MemorySetup) -> float:
    """Logits and their gradients at the loss, the largest single term for big vocabularies."""
    if not s.share.head:
        return 0.0
    a = s.model_args
    tokens = s.local_tokens
    act = DTYPE_BYTES[s.param_dtype]
    vocab = a.vocab_size / s.tp if s.loss_parallel else a.vocab_size
    if s.chunk_tokens <= 0:
        # Eager: the logits, their fp32 upcast, its log-softmax and their gradient; compiled
        # (parallelize.apply_compile): the logits and their gradient.
        return tokens * vocab * (2 * act if s.compiled_loss else 3 * 4 + (act if act != 4 else 0))
    chunk = min(s.chunk_tokens, tokens)
    # Backward (loss.py): fp32 grad_h [N, d], grad_w [V_local, d] in the weight's dtype (FSDP's
    # unsharded param_dtype, else the fp32 parameter), and a chunk-sized fp32 block accumulator.
    w_bytes = DTYPE_BYTES[s.param_dtype] if s.fsdp else 4
    grads = tokens * a.dim * 4 + a.vocab_size / s.tp * a.dim * w_bytes
    return chunk * vocab * (4 + act) + grads


def fsdp_buffer_bytes(counts: dict[str, int], s: MemorySetup) -> float:
    """Unsharded weights and grads that FSDP materializes during the step."""
    return fsdp_weight_bytes(counts, s) + fsdp_grad_bytes(counts, s) if s.fsdp else 0.0


def fsdp_weight_bytes(counts: dict[str, int], s: MemorySetup) -> float:
    """FSDP's all-gathered param_dtype weights. It all-gathers over dp_shard x cp only: the
    gathered weights are still TP-local (1/tp). The root stays unsharded for the whole step;
    so do a pipeline stage's blocks by default."""
    root = _held(counts, s, 0)
    keep_all = s.reshard_after_forward == "never" or (
        s.pp > 1 and s.reshard_after_forward == "default"
    )
    in_flight = s.share.blocks if keep_all else 2
    return (root + in_flight * _block_held(counts, s)) * DTYPE_BYTES[s.param_dtype]


def fsdp_grad_bytes(counts: dict[str, int], s: MemorySetup) -> float:
    """FSDP's unsharded gradients: one block's in fp32, the reduce-scatter input; under PP the
    stage's whole (torch's pipeline stage turns FSDP's gradient sync off for every microbatch's
    backward and syncs once after the last), accumulated in fp32, FSDP's reduce dtype. Below
    fp32 each gradient is also produced in param_dtype and upcast when its FSDP unit's backward
    ends: a block's at once, the root's at the end of the stage's backward, so the head's
    (made first) lives through all of it and the embedding's (made last) outlives no block's."""
    block = _block_held(counts, s)
    if s.pp == 1:
        return block * 4
    pb = DTYPE_BYTES[s.param_dtype]
    embedding, head = _root_held(counts, s)
    upcast = (head + max(block, embedding)) * pb if pb != 4 else 0.0
    return _held(counts, s, s.share.blocks) * 4 + upcast


def estimate(s: MemorySetup, counts: dict[str, int] | None = None) -> MemoryEstimate:
    """The live bytes at the larger of two peaks, the start of backward (activations, the loss,
    FSDP's buffers) and the optimizer step (every gradient, the step's temporaries), plus on
    CUDA what the allocator keeps cached. `counts` (param_counts of the same model) saves
    rebuilding the meta model per call."""
    counts = counts or param_counts(s.model_args, s.model_name)
    est = MemoryEstimate(num_params=counts["total"])
    on_device = 0 if s.cpu_offload else _local_params(counts, s)  # offloaded: in host memory
    working = {
        "unsharded weights / grads": fsdp_buffer_bytes(counts, s),
        f"activations (AC {s.ac_mode})": activation_bytes(s),
        "logits / loss" + (" (chunked)" if s.chunk_tokens else ""): loss_bytes(s),
    }
    # train.py zeroes gradients with set_to_none, so a step's first backward starts with no
    # sharded gradient; they appear block by block as its activations go. A later microbatch
    # of gradient accumulation starts with all of them.
    grads_at_backward = on_device * 4 if s.accumulation > 1 else 0.0
    backward = grads_at_backward + sum(working.values())
    states_row, states, temporaries = optimizer_bytes(counts, s, on_device)
    optimizer = on_device * 4 + temporaries  # every gradient + the step's temporaries
    est.rows["params (fp32, sharded)"] = on_device * 4
    if backward >= optimizer:
        est.peak = "start of backward"
        est.rows["grads (fp32, sharded)"] = grads_at_backward
        est.rows[states_row] = states
        est.rows.update(working)
    else:
        est.peak = "optimizer step"
        est.rows["grads (fp32, sharded)"] = on_device * 4
        est.rows[states_row] = states
        est.rows["optimizer-step temporaries"] = temporaries
    if s.device == "cuda":
        est.rows[CACHE_ROW] = CUDA_CACHED_FRACTION * min(backward, optimizer)
    return est


def optimizer_bytes(
    counts: dict[str, int], s: MemorySetup, on_device: float
) -> tuple[str, float, float]:
    """(row name, state bytes, step temporaries) of s.optimizer's recipe on this rank's device
    (nothing with CPU offload: the step runs in host memory)."""
    moment = 4 if s.optimizer == "Adam" else DTYPE_BYTES[s.state_dtype]  # AdamW's, maybe bf16
    short = "fp32" if moment == 4 else s.state_dtype
    if s.optimizer != "Muon":
        return f"{s.optimizer} states (2 x {short})", on_device * 2 * moment, on_device * 4
    name = f"Muon + AdamW states (1 x fp32 / 2 x {short})"
    if not on_device:
        return name, 0.0, 0.0
    # The block linears, sharded as the rest: Muon's. The other parameters: AdamW's.
    matrices = s.share.blocks * counts["block_split"] / s.tp / (s.dp_shard * s.cp)
    rest = on_device - matrices
    n, m = counts["largest_matrix"], counts["largest_matrix_short"]
    whole = 12 * n + 4 * m * m  # one whole matrix in Newton-Schulz (module docstring)
    return name, matrices * 4 + rest * 2 * moment, rest * 4 + whole


def estimate_stages(s: MemorySetup) -> list[MemoryEstimate]:
    """One estimate per pipeline rank (one in all without PP)."""
    return [estimate(replace(s, pp_rank=r)) for r in range(s.pp)]
