"""Every layout of a model on a cluster: checked as training checks it, its memory from the
estimator, its step time from the model in perf.py; ranked by tokens/s per GPU, then by the
fewest microbatches."""

from collections import Counter
from dataclasses import dataclass, field, replace
from itertools import product

from titanlite.config import ConfigError
from titanlite.memory_estimate import CACHE_ROW, GIB, estimate
from titanlite.parallel_dims import ParallelDims
from titanlite.plan.devices import Device
from titanlite.plan.perf import AC_CONFIG, Constants, Layout, Prediction, predict
from titanlite.plan.shape import Model, memory_setup
from titanlite.progress import Progress

# The CUDA context and NCCL's buffers live outside the caching allocator that the estimate
# describes; this is room left for them, an allowance rather than a measured figure.
DEFAULT_RESERVE_GIB = 3.0
SCHEDULES = ("1F1B", "Interleaved1F1B")
CHUNK_TOKENS = 2048  # llama_8b.toml's; the loss's memory is flat in it beyond ~1k tokens
MAX_LOCAL_BATCH = 16


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    device: Device
    reserve_gib: float = DEFAULT_RESERVE_GIB

    @property
    def usable_gib(self) -> float:
        return self.device.memory_gib - self.reserve_gib


@dataclass(frozen=True)
class Choices:
    """Which switches the search may turn (plan searches float8 only with --float8, else keeps
    it as the config has it; plan auto keeps float8 and compile as the config has them)."""

    ac: tuple[str, ...] = ("none", "selective", "selective_alternate", "full")
    chunk_tokens: tuple[int, ...] = (0, CHUNK_TOKENS)
    float8: tuple[bool, ...] = (False, True)
    compile: bool = True
    schedules: tuple[str, ...] = SCHEDULES


@dataclass
class Candidate:
    layout: Layout
    prediction: Prediction
    memory_gib: float  # the estimated peak of the layout's fullest pipeline rank


@dataclass
class Plan:
    fits: list[Candidate] = field(default_factory=list)  # best first
    rejected: Counter = field(default_factory=Counter)  # reason -> layouts


def powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def memory_gib(model: Model, lo: Layout, device: str = "cuda", live: bool = False, **run) -> float:
    """The estimator's peak of the fullest pipeline rank (the first holds the most microbatches
    in flight, the last the loss), or with `live` the bytes in use at it (no allocator cache);
    `run` as memory_setup takes it."""
    run.setdefault("optimizer", model.optimizer)
    setup = memory_setup(model.args, model.name, model.shape.seq_len, lo, device, **run)
    ests = [estimate(replace(setup, pp_rank=r), model.counts) for r in {0, lo.pp - 1}]
    fullest = max(ests, key=lambda e: e.total)
    return (fullest.total - (fullest.rows.get(CACHE_ROW, 0.0) if live else 0.0)) / GIB


def degrees(model: Model, cluster: Cluster, plan: Plan):
    """(tp, cp, pp) triples the model's shapes allow on the cluster; the others counted."""
    n, node = cluster.gpus, cluster.gpus_per_node
    for tp in [t for t in powers_of_two(min(node, n)) if n % t == 0]:
        for cp in [c for c in powers_of_two(n // tp) if n // tp % c == 0]:
            for pp in divisors(n // (tp * cp)):
                try:
                    ParallelDims(1, n // (tp * cp * pp), tp, n, cp, pp).validate_model(model.args)
                except ConfigError as e:
                    plan.rejected[_reason(e)] += 1
                    continue
                if pp > 1 and 2 * pp > model.shape.n_layers:
                    plan.rejected["fewer than 2 layers per pipeline stage"] += 1
                    continue
                yield tp, cp, pp


def _reason(e: ConfigError) -> str:
    """A rejection's kind: the error's first clause (its numbers vary, the kind does not)."""
    text = str(e)
    for words, kind in (("must divide both n_heads", "TP does not divide the heads"),
                        ("must divide the model", "TP does not divide dim or ffn dim"),
                        ("seq_len", "CP does not divide the sequence"),
                        ("microbatches per step", "too few microbatches for the schedule"),
                        ("stages per rank", "schedule does not fit the layer split")):  # fmt: skip
        if words in text:
            return kind
    return text.split(";")[0]


def search(model: Model, cluster: Cluster, global_batch: int, c: Constants,
           choices: Choices = Choices(), progress: bool = False) -> Plan:  # fmt: skip
    """Every layout of `global_batch` sequences on the cluster, fitting ones ranked. `progress`:
    lines on a terminal as the layouts are weighed (off where every rank plans: plan auto)."""
    plan = Plan()
    layouts = list(_layouts(model, cluster, global_batch, choices, plan))
    weighed = Progress(f"plan: search on {cluster.gpus} GPUs", len(layouts), unit="layouts",
                       scale=1, quiet=not progress)  # fmt: skip
    for lo in layouts:
        _consider(model, cluster, lo, c, plan)
        weighed.add(1)
    weighed.close()
    plan.fits.sort(key=_rank)
    return plan


def _rank(c: Candidate) -> tuple:
    """Fastest first, then the fewest forward passes a step, then the least memory. The model
    leaves out what a microbatch costs the host (kernel launches, FSDP's hooks per block:
    milliseconds per block on a GPU), so splitting a batch where it sees no gain only adds that."""
    return (-tied(c.prediction.tokens_per_s_per_gpu), c.prediction.terms["microbatches"],
            c.memory_gib)  # fmt: skip


def tied(tokens_per_s: float) -> float:
    """A predicted speed to 9 figures: layouts the model sees alike can differ in float
    rounding (116 such near-ties among 70B's layouts on 64 GPUs)."""
    return float(f"{tokens_per_s:.9g}")


def _layouts(model: Model, cluster: Cluster, global_batch: int, choices: Choices, plan: Plan):
    """The layouts to weigh; degrees and batch splits that cannot run are counted in `plan`."""
    float8 = [f for f in choices.float8 if not f or cluster.device.fp8_tflops > 0]
    for tp, cp, pp in degrees(model, cluster, plan):
        dp = cluster.gpus // (tp * cp * pp)
        if global_batch % dp:
            plan.rejected["global batch not divisible by the data-parallel degree"] += 1
            continue
        rows = global_batch // dp
        batches = [b for b in divisors(rows) if b <= MAX_LOCAL_BATCH or pp > 1]
        schedules = choices.schedules if pp > 1 else ("1F1B",)
        for rep, lbs, schedule, ac, chunk, f8 in product(
            divisors(dp), batches, schedules, choices.ac, choices.chunk_tokens, float8
        ):
            yield Layout(tp=tp, cp=cp, pp=pp, dp_replicate=rep, dp_shard=dp // rep,
                         schedule=schedule, local_batch_size=lbs, accumulation=rows // lbs, ac=ac,
                         chunk_tokens=chunk, float8=f8, compile=choices.compile)  # fmt: skip


def _consider(model: Model, cluster: Cluster, lo: Layout, c: Constants, plan: Plan) -> None:
    try:
        prediction = predict(model.shape, lo, cluster.device, cluster.gpus_per_node, c)
        mem = memory_gib(model, lo)
    except ConfigError as e:
        plan.rejected[_reason(e)] += 1
        return
    if mem > cluster.usable_gib:
        plan.rejected["out of memory"] += 1
        return
    plan.fits.append(Candidate(lo, prediction, mem))


FRUGAL = Choices(ac=("full",), chunk_tokens=(CHUNK_TOKENS,), float8=(False,))


def smallest_cluster(model: Model, cluster: Cluster, global_batch: int, c: Constants,
                     progress: bool = False) -> int:  # fmt: skip
    """The fewest GPUs (a power of two, whole nodes beyond one) on which the most frugal
    layouts of `global_batch` fit; 0 if none up to 16,384."""
    gpus = 1
    while gpus <= 16384:
        node = min(cluster.gpus_per_node, gpus)
        trial = Cluster(gpus, node, cluster.device, cluster.reserve_gib)
        if search(model, trial, global_batch, c, FRUGAL, progress).fits:
            return gpus
        gpus *= 2
    return 0


def flags(lo: Layout) -> list[str]:
    """The layout as train.py options, `--section.key value` pairs."""
    out = {
        "parallelism.data_parallel_replicate_degree": lo.dp_replicate,
        "parallelism.data_parallel_shard_degree": lo.dp_shard,
        "parallelism.tensor_parallel_degree": lo.tp,
        "parallelism.context_parallel_degree": lo.cp,
        "parallelism.pipeline_parallel_degree": lo.pp,
        "parallelism.pipeline_parallel_schedule": lo.schedule,
        "parallelism.pipeline_parallel_microbatch_size": lo.pp_microbatch_size,
        "training.local_batch_size": lo.local_batch_size,
        "training.global_batch_size": lo.global_batch,
        "activation_checkpoint.mode": AC_CONFIG[lo.ac][0],
        "activation_checkpoint.selective_ac_option": AC_CONFIG[lo.ac][1],
        "loss.chunk_tokens": lo.chunk_tokens,
    }
    argv = [a for k, v in out.items() for a in (f"--{k}", str(v))]
    argv.append("--compile.enable" if lo.compile else "--no-compile.enable")
    argv += ["--model.converters", "quantize.linear.float8" if lo.float8 else ""]
    if lo.float8 and lo.dp_shard * lo.cp > 1:
        argv.append("--quantize.linear.float8.enable_fsdp_float8_all_gather")
    return argv
