"""gpu_check's results: a run's figures from its metrics.jsonl, the pass rules, and the table.

Reads only files (metrics.jsonl as titanlite/metrics.py writes it, the text estimate_memory.py and
bench_loss.py print), so every rule here is tested on a CPU with synthetic files.
"""

import json
import re
import statistics
from pathlib import Path

WARMUP_STEPS = 3  # compile and allocator warm-up: left out of tokens/s and MFU
ESTIMATE_TOLERANCE = 0.15


# ---------------------------------------------------------------------------- reading results
def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _median(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def _max(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return max(values) if values else None


def summarize(records: list[dict], warmup: int = WARMUP_STEPS) -> dict:
    """A training run's figures from its metrics.jsonl records (log_freq 1): median tokens/s and
    MFU without the warm-up steps (all steps when there are no others), peak memory (active
    only where the run logged it) and allocator retries over every step, first and last loss."""
    train = sorted((r for r in records if r.get("loss") is not None), key=lambda r: r["step"])
    measured = train[warmup:] or train
    return {
        "steps": len(train),
        "wps": _median(measured, "wps"),
        "mfu": _median(measured, "mfu"),
        "active_gib": _max(train, "memory_active_gib"),
        "reserved_gib": _max(train, "memory_gib"),
        "retries": _max(train, "alloc_retries"),
        "loss_first": train[0]["loss"] if train else None,
        "loss_last": train[-1]["loss"] if train else None,
    }


def train_verdict(rc: int, figures: dict, estimate_gib: float | None = None) -> tuple[str, str]:
    """(PASS or FAIL, why) for a training run: exit 0, steps logged, loss fell, and the
    estimate (if any) within ESTIMATE_TOLERANCE of the measured peak reserved memory."""
    if rc != 0:
        return "FAIL", f"exit {rc}" + (" (timeout)" if rc == 124 else "")
    if not figures["steps"]:
        return "FAIL", "no step logged"
    if figures["steps"] > 1 and not figures["loss_last"] < figures["loss_first"]:
        return "FAIL", "loss did not fall"
    measured = figures["reserved_gib"]
    if estimate_gib is not None and measured and not estimate_ok(estimate_gib, measured):
        off = 100 * (estimate_gib / measured - 1)
        return "FAIL", f"estimate {off:+.0f}% off the measured peak (limit 15%)"
    return "PASS", ""


def estimate_ok(estimate_gib: float, measured_gib: float) -> bool:
    return abs(estimate_gib - measured_gib) <= ESTIMATE_TOLERANCE * measured_gib


def same_losses(a: list[dict], b: list[dict], after: int = 0, rtol: float = 0.0) -> tuple[str, str]:
    """(PASS or FAIL, why): the two runs logged the same steps after `after`, with losses equal
    to within `rtol` of a's (0: bitwise, and json keeps every bit of a float)."""

    def losses(records):
        return {r["step"]: r["loss"] for r in records if r.get("loss") is not None}

    la = {s: v for s, v in losses(a).items() if s > after}
    lb = {s: v for s, v in losses(b).items() if s > after}
    if not la or la.keys() != lb.keys():
        return "FAIL", f"steps after {after} differ: {len(la)} vs {len(lb)} logged"
    diff = max(abs(la[s] - lb[s]) for s in la)
    if not diff:
        return "PASS", f"{len(la)} steps after {after} bitwise equal"
    within = all(abs(la[s] - lb[s]) <= rtol * abs(la[s]) for s in la)
    return ("PASS" if within else "FAIL"), (
        f"max |loss difference| {diff:.3g} over {len(la)} steps after {after}"
        + (f" (tolerance {rtol:g} relative)" if rtol else "")
    )


def parse_estimate(text: str) -> float | None:
    """Peak GiB from estimate_memory.py's table, less a 'context / NCCL / slack' row where the
    estimator has one: memory outside the caching allocator, which the measured peak reserved
    does not include."""
    total = re.search(r"^total \(estimated peak per rank\)\s+([\d.]+)\s*$", text, re.M)
    if total is None:
        return None
    context = re.search(r"^context / NCCL / slack\s+([\d.]+)\s*$", text, re.M)
    return float(total.group(1)) - (float(context.group(1)) if context else 0.0)


def bench_loss_note(text: str) -> str:
    """'chunked 2048 0.25x memory 1.3x time, ...' from bench_loss.py's markdown table."""
    notes = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0].startswith("chunked") and len(cells) >= 5:
            notes.append(f"{cells[0]}: {cells[2]}x memory, {cells[4]}x time")
    return "; ".join(notes)


# ---------------------------------------------------------------------------- the table
COLUMNS = ("run", "device", "torch", "command", "tokens/s", "MFU %", "active GiB",
           "reserved GiB", "est. GiB", "retries", "loss first", "loss last", "result")  # fmt: skip


def _cell(value, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def table_row(row: dict) -> str:
    result = row["result"] + (f" ({row['why']})" if row.get("why") else "")
    cells = [
        row["name"], row["device"], row["torch"], f"`{row['command']}`",
        _cell(row.get("wps"), "{:,.0f}"), _cell(row.get("mfu"), "{:.1f}"),
        _cell(row.get("active_gib")), _cell(row.get("reserved_gib")),
        _cell(row.get("estimate_gib")), _cell(row.get("retries"), "{:.0f}"),
        _cell(row.get("loss_first"), "{:.4f}"), _cell(row.get("loss_last"), "{:.4f}"), result,
    ]  # fmt: skip
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def latest_rows(rows: list[dict]) -> list[dict]:
    """The newest row of each run name, in the order the names first appeared."""
    latest = {}
    for row in rows:
        latest[row["name"]] = row
    return list(latest.values())


def format_table(rows: list[dict], common_args: str) -> str:
    head = [
        f"Common to every train.py row: `{common_args}`; tokens/s and MFU are medians "
        f"per GPU without the first {WARMUP_STEPS} steps; memory is the peak over all steps; "
        "est. = scripts/estimate_memory.py's peak, less any allowance it adds for memory outside "
        "the allocator (CUDA context, NCCL).",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    return "\n".join([*head, *(table_row(r) for r in latest_rows(rows))]) + "\n"
