"""Throughput / MFU / memory sweep: each config is a fresh train.py run, read back from its JSONL.

    python scripts/benchmarks/benchmark.py                 # "cpu" preset: a few minutes on a laptop
    python scripts/benchmarks/benchmark.py --preset h100x8      # Llama 3 8B, FSDP 8 (one H100 node)
    python scripts/benchmarks/benchmark.py --preset cpu --steps 5 --warmup 2 \\
        --extra --training.seq_len 512
    python scripts/benchmarks/benchmark.py --list

A config is a name, a process count and a list of train.py override strings. Each runs for
warmup + steps steps with --metrics.log_freq 1 into {dump_folder}/bench/runs/<name>/ (plain
python for 1 process, torchrun otherwise); the first `warmup` logged steps are dropped. Step time
per step comes from elapsed_s deltas (train.py times each step; logging is outside that window).
Results go to {dump_folder}/bench/results.{md,csv,png}:
  tokens/s per device (median), TFLOP/s per device, MFU (train.py's: against the device table, or
  on CPU a matmul calibration per process), peak memory (max over steps of train.py's memory_gib:
  CUDA max reserved, or on CPU the process's peak RSS), step time median and min-max spread.

A model shape missing from the flavor table can be given as "dim,n_layers,n_heads" in a config's
fourth field: the run then goes through this script's `--_train` entry, which adds the shape to
the in-process flavor table before calling train.main (args.py is not touched).
"""

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEBUG = ["--job.config_file", "debug_model.toml"]
_8B = ["--job.config_file", "llama_8b.toml", "--no-checkpoint.enable"]
_SAC = "--activation_checkpoint.selective_ac_option"

# name -> list of (config name, nproc, overrides, custom model "dim,n_layers,n_heads" or "").
PRESETS: dict[str, list[tuple[str, int, list[str], str]]] = {
    "cpu": [
        ("debug_fp32_1p", 1, [*DEBUG, "--training.mixed_precision_param", "float32"], ""),
        ("debug_bf16_1p", 1, [*DEBUG], ""),
        ("debug_fp32_fsdp2", 2, [*DEBUG, "--training.mixed_precision_param", "float32"], ""),
        ("debug_fp32_ac_full", 1, [*DEBUG, "--training.mixed_precision_param", "float32",
                                   "--activation_checkpoint.mode", "full"], ""),
        ("debug_fp32_chunk512", 1, [*DEBUG, "--training.mixed_precision_param", "float32",
                                    "--loss.chunk_tokens", "512"], ""),
    ],
    # The docs/performance.md table: debug and ~100M (dim 768, 12 layers, 12 heads) models,
    # 1/2/4 processes (FSDP), fp32 vs bf16. Small batches: a CPU step of 100M is slow.
    "cpu_table": [
        (f"{m}_{dt}_{n}p", n, [*DEBUG, "--training.mixed_precision_param", dt, *extra], custom)
        for m, custom, extra in (
            ("debug", "", []),
            ("100M", "768,12,12", ["--training.local_batch_size", "1"]),  # 256 tokens
        )
        for dt in ("float32", "bfloat16")
        for n in (1, 2, 4)
    ],
    # Pipeline vs FSDP on 2 processes, the same global batch of 16 sequences: FSDP 2 runs one
    # microbatch of 8 per rank, PP 2 two schedule steps of 8 pipeline microbatches of 1.
    "cpu_pp": [
        (name, n, [*DEBUG, "--training.mixed_precision_param", "float32",
                   "--training.local_batch_size", "8", "--training.global_batch_size", "16",
                   *extra], "")
        for name, n, extra in (
            ("debug_fp32_1p", 1, []),
            ("debug_fp32_fsdp2", 2, []),
            ("debug_fp32_pp2_1f1b", 2, ["--parallelism.pipeline_parallel_degree", "2"]),
            ("debug_fp32_pp2_gpipe", 2, ["--parallelism.pipeline_parallel_degree", "2",
                                         "--parallelism.pipeline_parallel_schedule", "GPipe"]),
            ("debug_fp32_pp2_interleaved1f1b", 2, [
                "--parallelism.pipeline_parallel_degree", "2",
                "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
        )
    ],
    # Document masking and emulated float8 against the plain run, one process, fp32, at 256 and
    # 2,048 tokens per row (the dense document mask grows with the square of it).
    "cpu_features": [
        (f"debug_fp32_{name}_seq{seq}", 1, [
            *DEBUG, "--training.mixed_precision_param", "float32", "--training.seq_len", str(seq),
            "--training.local_batch_size", str(8 * 256 // seq), *extra], "")
        for seq in (256, 2048)
        for name, extra in (
            ("plain", []),
            ("document_masking", ["--model.document_masking"]),
            ("float8_emulated", ["--model.converters", "quantize.linear.float8",
                                 "--quantize.linear.float8.emulate"]),
        )
    ],
    "h100x8": [
        ("8b_fsdp8_sac_op", 8, [*_8B, "--no-compile.enable", "--loss.chunk_tokens", "0"], ""),
        ("8b_fsdp8_sac_op_compile", 8, [*_8B, "--loss.chunk_tokens", "0"], ""),
        ("8b_fsdp8_sac_op_compile_chunk", 8, [*_8B], ""),
        ("8b_fsdp8_full_ac_compile_chunk", 8, [*_8B, "--activation_checkpoint.mode", "full"], ""),
        ("8b_fsdp8_ac_every2_compile_chunk", 8, [*_8B, _SAC, "2"], ""),
        ("8b_fsdp8_no_ac_compile_chunk", 8, [*_8B, "--activation_checkpoint.mode", "none"], ""),
        ("8b_fsdp8_sac_op_compile_chunk_lbs2", 8, [*_8B, "--training.local_batch_size", "2"], ""),
    ],
}  # fmt: skip

COLUMNS = (
    "config", "nproc", "tokens_per_s_per_device", "tflops_per_device", "mfu_pct",
    "peak_memory_gib", "step_ms_median", "step_ms_min", "step_ms_max", "steps_measured",
)  # fmt: skip


def command(nproc: int, overrides: list[str], custom: str, dump: Path, total_steps: int):
    train_args = [
        *overrides,
        "--job.dump_folder", str(dump),
        "--training.steps", str(total_steps),
        "--metrics.log_freq", "1",
        "--no-metrics.enable_tensorboard",
    ]  # fmt: skip
    script = [str(REPO / "train.py")]
    if custom:
        script = [str(Path(__file__).resolve()), "--_train", custom]
    if nproc == 1:
        return [sys.executable, *script, *train_args]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*launch, f"--nproc_per_node={nproc}", *script, *train_args]


def summarize(name: str, nproc: int, records: list[dict], warmup: int) -> dict:
    """One table row from a run's JSONL records (log_freq 1), warm-up steps dropped."""
    records = sorted(records, key=lambda r: r["step"])
    if len(records) <= warmup:
        raise ValueError(f"{name}: {len(records)} logged steps, need more than {warmup} warm-up")
    # elapsed_s is the cumulative step time of a fresh run: its deltas are the step times.
    elapsed = [0.0] + [r["elapsed_s"] for r in records]
    steps = [b - a for a, b in zip(elapsed, elapsed[1:])][warmup:]
    measured = records[warmup:]
    med = lambda key: statistics.median(r[key] for r in measured)  # noqa: E731
    mfu = [r["mfu"] for r in measured if r.get("mfu") is not None]
    return {
        "config": name,
        "nproc": nproc,
        "tokens_per_s_per_device": med("wps"),
        "tflops_per_device": med("tflops"),
        "mfu_pct": statistics.median(mfu) if mfu else None,
        "peak_memory_gib": max(r["memory_gib"] for r in records),
        "step_ms_median": 1e3 * statistics.median(steps),
        "step_ms_min": 1e3 * min(steps),
        "step_ms_max": 1e3 * max(steps),
        "steps_measured": len(steps),
    }


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def write_outputs(rows: list[dict], out: Path, header: str) -> None:
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    lines = [header, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in COLUMNS) + " |" for r in rows]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    plot(rows, out / "results.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    names = [r["config"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.2 * len(rows) + 4), 4.5))
    for ax, key, label in (
        (axes[0], "tokens_per_s_per_device", "tokens/s per device (median)"),
        (axes[1], "peak_memory_gib", "peak memory per device (GiB)"),
    ):
        ax.bar(range(len(rows)), [r[key] for r in rows], color="tab:blue")
        ax.set_xticks(range(len(rows)), names, rotation=45, ha="right", fontsize=8)
        ax.set_title(label)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_sweep(configs, opts) -> list[dict]:
    out = Path(opts.dump_folder) / "bench"
    rows = []
    for i, (name, nproc, overrides, custom) in enumerate(configs, 1):
        dump = out / "runs" / name
        (dump / "metrics.jsonl").unlink(missing_ok=True)  # JSONL appends: start clean
        cmd = command(nproc, [*overrides, *opts.extra], custom, dump, opts.warmup + opts.steps)
        print(f"[{i}/{len(configs)}] {name}: {' '.join(cmd[1:])}", flush=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if opts.omp_threads:
            env["OMP_NUM_THREADS"] = str(opts.omp_threads)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        (dump / "stdout.log").parent.mkdir(parents=True, exist_ok=True)
        (dump / "stdout.log").write_text(proc.stdout + proc.stderr)
        jsonl = dump / "metrics.jsonl"
        records = [json.loads(x) for x in jsonl.read_text().splitlines()] if jsonl.exists() else []
        if proc.returncode != 0:
            print(f"    FAILED (exit {proc.returncode}); log: {dump / 'stdout.log'}")
            print("    " + "\n    ".join((proc.stdout + proc.stderr).strip().splitlines()[-5:]))
            if len(records) < opts.warmup + opts.steps:
                continue
            # Every step was logged, so the numbers are valid; the crash was at shutdown.
            print("    (all steps were logged before the failure: the row is kept, marked '!')")
            name += " !"
        row = summarize(name, nproc, records, opts.warmup)
        rows.append(row)
        print(
            f"    {row['tokens_per_s_per_device']:,.0f} tokens/s/device, step "
            f"{row['step_ms_median']:,.0f} ms ({row['step_ms_min']:,.0f}-"
            f"{row['step_ms_max']:,.0f}), mem {row['peak_memory_gib']:.2f} GiB, "
            f"mfu {_fmt(row['mfu_pct'])}%  [{time.perf_counter() - t0:.0f} s]",
            flush=True,
        )
    if rows:
        header = (
            f"Sweep {opts.preset!r}: {opts.warmup} warm-up + {opts.steps} measured steps per "
            f"config; OMP_NUM_THREADS={opts.omp_threads or os.environ.get('OMP_NUM_THREADS', '')}"
            f"; extra: {' '.join(opts.extra) or '-'}. '!': the run exited non-zero after "
            "logging every step (see its stdout.log)."
        )
        write_outputs(rows, out, header)
        print(f"wrote {out / 'results.md'}, results.csv, results.png")
    return rows


def train_entry(argv: list[str]) -> int:
    """`--_train dim,n_layers,n_heads <train.py args>`: train.py with a custom flavor added."""
    sys.path.insert(0, str(REPO))
    import train
    from titanlite.models.llama.args import LLAMA3_FLAVORS, ModelArgs

    dim, layers, heads = (int(x) for x in argv[0].split(","))
    name = f"custom_{dim}x{layers}x{heads}"
    LLAMA3_FLAVORS[name] = ModelArgs(dim=dim, n_layers=layers, n_heads=heads)
    return train.main([*argv[1:], "--model.flavor", name])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_train"]:
        return train_entry(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    p.add_argument("--only", default="", help="comma-separated config names from the preset")
    p.add_argument("--warmup", type=int, default=2, help="logged steps dropped (>= 1)")
    p.add_argument("--steps", type=int, default=4, help="measured steps per config")
    p.add_argument("--dump_folder", default="./outputs")
    p.add_argument("--omp_threads", type=int, default=0, help="OMP_NUM_THREADS per process")
    p.add_argument("--list", action="store_true", help="print the presets and exit")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="train.py overrides")
    opts = p.parse_args(argv)
    if opts.list:
        for preset, configs in PRESETS.items():
            print(f"{preset}:")
            for name, nproc, overrides, custom in configs:
                print(f"  {name} (nproc {nproc}{', model ' + custom if custom else ''}): "
                      f"{' '.join(overrides)}")  # fmt: skip
        return 0
    if opts.warmup < 1 or opts.steps < 2:
        raise SystemExit("need --warmup >= 1 (step 1 pays for allocation) and --steps >= 2")
    configs = PRESETS[opts.preset]
    if opts.only:
        wanted = opts.only.split(",")
        unknown = sorted(set(wanted) - {c[0] for c in configs})
        if unknown:
            raise SystemExit(f"--only: {unknown} not in preset {opts.preset!r}; see --list")
        configs = [c for c in configs if c[0] in wanted]
    return 0 if run_sweep(configs, opts) else 1


if __name__ == "__main__":
    sys.exit(main())
