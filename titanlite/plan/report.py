"""The planner's text output: a header, the ranked table, the rejections, one row explained."""

from titanlite.plan.perf import Constants
from titanlite.plan.search import Candidate, Cluster, Plan, flags
from titanlite.plan.shape import Model

COLUMNS = (("#", 3), ("layout", 42), ("batch", 8), ("AC", 10), ("loss", 6), ("f8", 3),
           ("tok/s/GPU", 10), ("MFU%", 6), ("step s", 8), ("compute", 8), ("recomp", 7),
           ("tp/cp/pp", 9), ("bubble", 7), ("dp exp", 7), ("optim", 6), ("GiB", 6))  # fmt: skip


def header(cfg, model: Model, cluster: Cluster, batch: int, c: Constants) -> str:
    d, s = cluster.device, model.shape
    return (
        f"{cfg.model.flavor}: {s.params_total / 1e9:.2f} B params, vocab {s.vocab}, seq "
        f"{s.seq_len}; global batch {batch} x {s.seq_len} = {batch * s.seq_len:,} tokens\n"
        f"cluster: {cluster.gpus} x {d.name} ({cluster.gpus_per_node} per node; "
        f"{d.memory_gib:g} GiB, {cluster.reserve_gib:g} left outside the estimate; "
        f"{d.bf16_tflops:g} TFLOP/s bf16; links {d.intra_node_gbps:g} / {d.inter_node_gbps:g} "
        f"GB/s in / across nodes)\nconstants: {c.source}"
    )


def table(rows: list[Candidate]) -> str:
    lines = ["".join(f"{name:<{w}} " if i < 2 else f"{name:>{w}} " for i, (name, w) in
                     enumerate(COLUMNS))]  # fmt: skip
    for i, c in enumerate(rows, 1):
        lo, p = c.layout, c.prediction
        sp = p.split
        cells = (i, lo.describe(), f"{lo.local_batch_size}x{lo.accumulation}", lo.ac,
                 "chunk" if lo.chunk_tokens else "plain", "f8" if lo.float8 else "-",
                 f"{p.tokens_per_s_per_gpu:,.0f}", mfu(c).split()[1].rstrip("%"), f"{p.step_s:.3f}",
                 f"{sp['compute']:.3f}", f"{sp['recompute']:.3f}", f"{sp['tp_cp_pp_comm']:.3f}",
                 f"{sp['bubble']:.3f}", f"{sp['dp_comm_exposed']:.3f}", f"{sp['optimizer']:.3f}",
                 f"{c.memory_gib:.1f}")  # fmt: skip
        lines.append("".join(f"{str(v):<{w}} " if j < 2 else f"{str(v):>{w}} "
                             for j, (v, (_, w)) in enumerate(zip(cells, COLUMNS))))  # fmt: skip
    return "\n".join(lines)


def rejections(plan: Plan) -> str:
    return ", ".join(f"{why}: {n}" for why, n in plan.rejected.most_common()) or "none"


def summary(plan: Plan) -> str:
    return f"{len(plan.fits)} layouts fit; rejected: {rejections(plan)}"


def mfu(c: Candidate) -> str:
    """As train.py reports it: none for float8 linears, whose peak is not the bf16 one."""
    return "MFU - (float8)" if c.layout.float8 else f"MFU {100 * c.prediction.mfu:.1f}%"


def explain(c: Candidate) -> str:
    """The arithmetic behind one row: its options, the terms, the time split."""
    p = c.prediction
    lines = [f"layout: {c.layout.describe()}", "train.py flags: " + " ".join(flags(c.layout))]
    lines += [f"  {k:<24} {v:,.4g}" for k, v in p.terms.items()]
    lines += [f"  step = {' + '.join(f'{k} {v:.4f}' for k, v in p.split.items())} = "
              f"{p.step_s:.4f} s",
              f"  tokens/s per GPU {p.tokens_per_s_per_gpu:,.0f}; {mfu(c)}; "
              f"estimated peak {c.memory_gib:.2f} GiB (fullest pipeline rank)"]  # fmt: skip
    return "\n".join(lines)
