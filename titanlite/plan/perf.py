"""The step-time model: one rank's optimizer step from FLOPs, bytes and the device's figures.

Per rank and step (T = tokens the rank processes per step, L its transformer blocks):
- matmuls: 6 x (block linear params / tp) x L x T, plus the output projection 6 x V' x dim x T
  on the last pipeline stage (8 with the chunked loss, which recomputes the logits in backward;
  V' = V / tp under loss parallel); time = FLOPs / (peak x matmul_efficiency), float8 linears
  divide the block matmul time by float8_matmul_speedup.
- attention: causal flash attention executes 2 x S x heads/tp x head_dim FLOPs per token forward
  and 2.5 times that backward: 7 x S x heads/tp x head_dim per token and block, at
  attention_efficiency. Under CP each rank's two load-balanced chunks attend, with a boolean
  mask, to their whole key prefix: (1 + 1 / 2cp) times the causal work, at the lower
  masked_attention_efficiency of the kernels that take a mask.
- everything else (norms, RoPE, SwiGLU's product, residuals, casts): memory-bound passes over
  the block's activations, (dim + ffn_dim) / tp elements per token, each read or written once
  per pass: time = passes x bytes / HBM bandwidth, with fewer passes compiled than eager.
- activation checkpointing recomputes: full, each block's whole forward (a third of its matmul
  FLOPs, 2/7 of its attention, its elementwise forward); selective (op), only the elementwise
  forward, since matmul and attention outputs are saved; selective_alternate (op_alternate)
  also the forward of k, wo and w3, every second matmul.
- the optimizer: fused AdamW reads param, grad and two moments and writes three (28 bytes per
  local fp32 parameter) at HBM bandwidth. Muon (optimizer.name's recipe) reads param, grad and
  its momentum and writes two (20 bytes) for the block linears, and runs Newton-Schulz on each
  whole matrix, the matrices dealt over all ranks: ns_steps x (4 m^2 n + 2 m^3) FLOPs for an
  n x m matrix (m <= n) at matmul_efficiency; its gathers and broadcasts are not modelled.
- FSDP over dp_shard x cp ranks: per microbatch, the block weights are all-gathered in
  param_dtype (float8 for float8 linears) for forward and again for backward (not under PP,
  where stages keep them), and the fp32 gradients reduce-scattered; HSDP adds an all-reduce of
  the gradient shards over dp_replicate. Each moves (n - 1) / n of the unsharded bytes through
  one link at comm_efficiency of its bandwidth: NVLink when the group's ranks (consecutive
  blocks of tp x its size in the mesh order pp, dp_replicate, dp_shard, cp, tp) fit in a node,
  the network otherwise. FSDP prefetches, so its traffic hides under compute: only the excess,
  plus the first block's all-gather, is exposed.
- TP with sequence parallelism: per block and microbatch, two all-gathers and two
  reduce-scatters of [tokens, dim] activations forward and again backward (4 more if full AC
  recomputes), on the critical path. CP (all-gather): the whole sequence's K and V gathered per
  block forward, again in backward (recomputed under AC), and their gradients reduce-scattered.
  PP: one [tokens, dim] send per microbatch and stage boundary each way.
- pipeline bubble: the slowest rank's work stretched by (pp - 1) / (n x v) for n microbatches
  and v stages per rank (1F1B, GPipe, interleaved); zero-bubble schedules fill two thirds of it.
Step time = (compute + recompute + TP/CP/PP traffic) x (1 + bubble) + exposed FSDP traffic +
optimizer. tokens/s per GPU = global tokens / step time / world; MFU as train.py reports it.

Not modelled: kernel-launch and Python overhead (hidden by compile and large steps on GPUs; for
it the search ranks layouts predicted equally fast by the fewest microbatches), overlap of TP and
CP traffic with compute, network contention between groups, and the data loader. The
efficiencies are calibrated from real runs (titanlite/plan/calibrate.py).
"""

from dataclasses import asdict, dataclass, field

from titanlite.config import Parallelism
from titanlite.models.pipeline_plan import LOOPED, SINGLE_STAGE, V_SHAPED, plan_pipeline
from titanlite.plan.devices import Device

ADAMW_BYTES_PER_PARAM = 28  # fused AdamW: read p, g, m, v; write p, m, v (fp32)
MUON_BYTES_PER_PARAM = 20  # Muon: read p, g, buf; write p, buf (fp32)
MUON_NS_STEPS = 5  # optimizer.muon_ns_steps' default
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class Constants:
    """What the model cannot derive: achieved fractions of the device's peaks. The defaults are
    a fit to seven single-GPU runs on an H200 (torch 2.11, compiled and eager; 1B and 8B's block
    shape, 2K-16K tokens, every AC mode; docs/performance.md), rounded; comm_efficiency and
    float8_matmul_speedup are not measured yet (one GPU has no collectives; no float8 run was
    in the fit)."""

    matmul_efficiency: float = 0.51  # of the dense bf16 peak: the step's GEMMs, casts included
    attention_efficiency: float = 0.54  # flash/cuDNN fwd+bwd (alone: 0.40-0.54 by head_dim)
    elementwise_passes: float = 39.0  # compiled: reads and writes per activation element
    eager_elementwise_passes: float = 70.0  # eager: more, unfused
    comm_efficiency: float = 0.75  # of the link bandwidth that NCCL's collectives reach
    float8_matmul_speedup: float = 1.3  # block matmuls in float8 vs bf16, scaling included
    # CP attends with a boolean mask, which only the memory-efficient and cuDNN kernels take,
    # over the whole key prefix: an H100 ran it at 0.30 of peak (docs/performance.md, sdpa_kernels).
    masked_attention_efficiency: float = 0.30
    source: str = "defaults (fitted on one H200)"


# The planner's AC values as train.py's activation_checkpoint (mode, selective_ac_option).
AC_CONFIG = {
    "none": ("none", "op"),
    "selective": ("selective", "op"),
    "selective_alternate": ("selective", "op_alternate"),
    "full": ("full", "op"),
}


@dataclass(frozen=True)
class Layout:
    """One candidate: degrees, batch split, and the memory/speed switches."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    schedule: str = "1F1B"
    local_batch_size: int = 1  # rows per microbatch per data-parallel rank
    accumulation: int = 1  # microbatches per optimizer step
    pp_microbatch_size: int = 1  # rows per pipeline microbatch (local_batch_size splits into them)
    ac: str = "selective"  # a key of AC_CONFIG
    chunk_tokens: int = 0
    float8: bool = False
    compile: bool = True

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp_replicate * self.dp_shard

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def global_batch(self) -> int:
        return self.local_batch_size * self.dp * self.accumulation

    def describe(self) -> str:
        parts = [f"{n} {v}" for n, v in (("tp", self.tp), ("cp", self.cp), ("pp", self.pp),
                                         ("hsdp", self.dp_replicate)) if v > 1]  # fmt: skip
        parts.append(f"fsdp {self.dp_shard}")
        if self.pp > 1:
            parts.append(self.schedule)
        return " x ".join(parts)


@dataclass(frozen=True)
class Shape:
    """The model and step arithmetic the time model needs (from param_counts and ModelArgs)."""

    dim: int
    ffn_dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    kv_dim: int
    vocab: int
    block_linear_params: int  # one block's TP-split parameters
    params_total: int
    flops_per_token: float  # train.py's MFU convention
    seq_len: int
    optimizer: str = "AdamW"  # optimizer.name


@dataclass
class Prediction:
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    split: dict[str, float]  # seconds per step: compute, recompute, exposed comm, bubble, ...
    terms: dict[str, float] = field(default_factory=dict)  # the arithmetic, for --explain

    def as_dict(self) -> dict:
        return asdict(self)


def link_gbps(device: Device, span: int, gpus_per_node: int) -> float:
    """Bandwidth of a group whose ranks occupy `span` consecutive ranks of the mesh."""
    return device.intra_node_gbps if span <= gpus_per_node else device.inter_node_gbps


def collective_s(nbytes: float, group: int, gbps: float, c: Constants) -> float:
    """All-gather or reduce-scatter of `nbytes` (the full tensor) over `group` ranks."""
    if group <= 1:
        return 0.0
    return nbytes * (group - 1) / group / (gbps * 1e9 * c.comm_efficiency)


def pipeline_options(layout: Layout) -> Parallelism:
    """The [parallelism] section of `layout` (the pipeline options plan_pipeline reads)."""
    return Parallelism(
        data_parallel_replicate_degree=layout.dp_replicate,
        data_parallel_shard_degree=layout.dp_shard,
        context_parallel_degree=layout.cp,
        tensor_parallel_degree=layout.tp,
        pipeline_parallel_degree=layout.pp,
        pipeline_parallel_schedule=layout.schedule,
        pipeline_parallel_microbatch_size=layout.pp_microbatch_size,
    )


def rank_blocks(shape: Shape, layout: Layout) -> list[int]:
    """Transformer blocks on each pipeline rank, by the split training uses (the last rank also
    holds the output head); raises ConfigError for a split the schedule cannot run."""
    if layout.pp == 1:
        return [shape.n_layers]
    plan = plan_pipeline(shape.n_layers, layout.pp, layout.local_batch_size,
                         pipeline_options(layout))  # fmt: skip
    ids = [plan.stage_ids(r, layout.pp) for r in range(layout.pp)]
    return [sum(len(plan.stage_layers[i]) for i in stages) for stages in ids]


@dataclass
class _Step:
    """What every part of one rank's step shares; `t` collects the terms --explain shows."""

    s: Shape
    lo: Layout
    device: Device
    gpus_per_node: int
    c: Constants
    param_bytes: int
    tokens: float  # this rank processes per step
    micro: int  # forward passes per step (accumulation x pipeline microbatches)
    t: dict

    @property
    def peak(self) -> float:
        return self.device.bf16_tflops * 1e12

    def seconds(self, nbytes: float, group: int, span: int) -> float:
        return collective_s(nbytes, group, link_gbps(self.device, span, self.gpus_per_node), self.c)


def predict(shape: Shape, layout: Layout, device: Device, gpus_per_node: int, c: Constants,
            param_bytes: int = 2) -> Prediction:  # fmt: skip
    """The step time of `layout` for `shape` on `device` (see the module docstring)."""
    lo, s = layout, shape
    rows = lo.local_batch_size * lo.accumulation  # sequences per dp rank per step
    micro = lo.accumulation * (lo.local_batch_size // lo.pp_microbatch_size if lo.pp > 1 else 1)
    tokens = rows * s.seq_len / lo.cp
    st = _Step(s, lo, device, gpus_per_node, c, param_bytes, tokens, micro,
               {"tokens_per_rank": tokens, "microbatches": micro})  # fmt: skip
    block, recompute, comm = block_seconds(st)
    head, send = head_seconds(st)
    per_rank = rank_blocks(s, lo)
    works = [n * (block + recompute + comm) + send for n in per_rank]
    works[-1] += head
    busiest = max(range(lo.pp), key=works.__getitem__)
    blocks, work = per_rank[busiest], works[busiest]
    bubble = pipeline_bubble(lo, micro) * work
    compute = blocks * (block + recompute) + (head if busiest == lo.pp - 1 else 0.0)
    exposed = dp_exposed_seconds(st, blocks, compute)
    optim = optimizer_seconds(s, lo, device, st.peak * c.matmul_efficiency)
    step = work + bubble + exposed + optim
    tps = rows * lo.dp * s.seq_len / step / lo.world
    st.t["blocks_on_busiest_rank"] = blocks
    split = {"compute": compute - blocks * recompute, "recompute": blocks * recompute,
             "tp_cp_pp_comm": blocks * comm + send, "bubble": bubble,
             "dp_comm_exposed": exposed, "optimizer": optim}  # fmt: skip
    return Prediction(step, tps, s.flops_per_token * tps / st.peak, split, st.t)


def block_seconds(st: _Step) -> tuple[float, float, float]:
    """One block over the rank's tokens of the step: (compute, AC recompute, TP + CP traffic)."""
    s, lo, c, t = st.s, st.lo, st.c, st.t
    mm_speed = c.float8_matmul_speedup if lo.float8 else 1.0
    t["block_matmul_tflop"] = 6 * s.block_linear_params / lo.tp * st.tokens / 1e12
    t["block_attention_tflop"] = 7 * s.seq_len * s.n_heads / lo.tp * s.head_dim * st.tokens / 1e12
    mm = t["block_matmul_tflop"] * 1e12 / (st.peak * c.matmul_efficiency * mm_speed)
    attn = t["block_attention_tflop"] * 1e12 / (st.peak * c.attention_efficiency)
    if lo.cp > 1:  # masked calls over each chunk's whole key prefix: (1 + 1 / 2cp) the work
        attn *= (1 + 1 / (2 * lo.cp)) * c.attention_efficiency / c.masked_attention_efficiency
    passes = c.elementwise_passes if lo.compile else c.eager_elementwise_passes
    elem = (
        passes
        * (s.dim + s.ffn_dim)
        / lo.tp
        * st.param_bytes
        * st.tokens
        / (st.device.hbm_gbps * 1e9)
    )
    alternate = s.dim * (s.kv_dim + s.dim + s.ffn_dim) / s.block_linear_params  # k, wo, w3
    recompute = {"none": 0.0, "selective": elem / 3,
                 "selective_alternate": (alternate * mm + elem) / 3,
                 "full": mm / 3 + attn * 2 / 7 + elem / 3}[lo.ac]  # fmt: skip
    act_mb = st.tokens / st.micro * s.dim * st.param_bytes  # one [tokens, dim] per microbatch
    tp = (8 + (4 if lo.ac == "full" else 0)) * st.micro * st.seconds(act_mb, lo.tp, lo.tp)
    kv_mb = st.tokens / st.micro * lo.cp * 2 * s.kv_dim / lo.tp * st.param_bytes  # gathered K, V
    cp = (3 if lo.ac != "none" else 2) * st.micro * st.seconds(kv_mb, lo.cp, lo.cp * lo.tp)
    t.update(block_s=mm + attn + elem, block_matmul_s=mm, block_attention_s=attn,
             block_elementwise_s=elem, block_recompute_s=recompute, block_tp_s=tp,
             block_cp_s=cp)  # fmt: skip
    return mm + attn + elem, recompute, tp + cp


def head_seconds(st: _Step) -> tuple[float, float]:
    """(the output projection and loss on the last pipeline rank, each rank's PP sends)."""
    s, lo, c = st.s, st.lo, st.c
    vocab = s.vocab / lo.tp if lo.tp > 1 else s.vocab  # loss parallel under TP
    st.t["head_tflop"] = (8 if lo.chunk_tokens else 6) * vocab * s.dim * st.tokens / 1e12
    head = st.t["head_tflop"] * 1e12 / (st.peak * c.matmul_efficiency)
    act_mb = st.tokens / st.micro * s.dim * st.param_bytes
    pp_gbps = link_gbps(st.device, lo.world, st.gpus_per_node)  # stages: the outermost mesh dim
    send = 2 * st.micro * act_mb / (pp_gbps * 1e9 * c.comm_efficiency) if lo.pp > 1 else 0.0
    st.t.update(head_s=head, pp_send_s=send)
    return head, send


def optimizer_seconds(s: Shape, lo: Layout, device: Device, matmul_flops: float) -> float:
    """One rank's optimizer step: its elementwise traffic, and Muon's Newton-Schulz share."""
    per_rank = lo.tp * lo.pp * lo.dp_shard * lo.cp  # the ways each parameter is split
    local = s.params_total / per_rank
    if s.optimizer != "Muon":
        return local * ADAMW_BYTES_PER_PARAM / (device.hbm_gbps * 1e9)
    matrices = s.block_linear_params * s.n_layers / per_rank
    traffic = matrices * MUON_BYTES_PER_PARAM + (local - matrices) * ADAMW_BYTES_PER_PARAM
    shapes = [(s.dim, s.dim)] * 2 + [(s.kv_dim, s.dim)] * 2 + [(s.ffn_dim, s.dim)] * 3
    block = sum(4 * min(a, b) ** 2 * max(a, b) + 2 * min(a, b) ** 3 for a, b in shapes)
    ns = MUON_NS_STEPS * block * s.n_layers / lo.world  # every rank takes a share
    return traffic / (device.hbm_gbps * 1e9) + ns / matmul_flops


def dp_exposed_seconds(st: _Step, blocks: int, compute: float) -> float:
    """FSDP / HSDP traffic of the busiest rank's blocks: hidden under its compute, but the
    first all-gather and whatever exceeds the compute."""
    s, lo = st.s, st.lo
    fsdp = lo.dp_shard * lo.cp
    weights = s.block_linear_params / lo.tp  # one block's elements on this rank, unsharded
    gather = st.seconds(weights * (1 if lo.float8 else st.param_bytes), fsdp, fsdp * lo.tp)
    reduce = st.seconds(weights * 4, fsdp, fsdp * lo.tp)
    traffic = ((1 if lo.pp > 1 else 2) * gather + reduce) * blocks * lo.accumulation
    if lo.dp_replicate > 1:
        shard = weights * blocks * 4 / fsdp
        span = lo.dp_replicate * fsdp * lo.tp
        traffic += 2 * st.seconds(shard, lo.dp_replicate, span) * lo.accumulation
    st.t.update(dp_traffic_s=traffic, first_gather_s=gather,
                fsdp_link_gbps=link_gbps(st.device, fsdp * lo.tp, st.gpus_per_node))  # fmt: skip
    return max(0.0, traffic - compute) + gather


def pipeline_bubble(layout: Layout, microbatches: int) -> float:
    """Idle fraction added to the busiest rank's work by the schedule's warm-up and drain."""
    if layout.pp == 1:
        return 0.0
    v = 1 if layout.schedule in SINGLE_STAGE else 2
    bubble = (layout.pp - 1) / (microbatches * v)
    if layout.schedule in ZERO_BUBBLE:
        bubble /= 3
    assert layout.schedule in SINGLE_STAGE + LOOPED + V_SHAPED, layout.schedule
    return bubble
