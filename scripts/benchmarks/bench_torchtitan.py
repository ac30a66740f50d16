"""titanlite beside torchtitan on this machine: same model, data, batch and recipe, global tokens/s.

    python scripts/benchmarks/bench_torchtitan.py --torchtitan /work/scratch/torchtitan \\
        --torchtitan-python /work/scratch/tt-venv/bin/python               # 4 configs x 3 repeats
    # a smoke run:
    python scripts/benchmarks/bench_torchtitan.py ... --configs dp1_fp32 --steps 8 --repeats 1

The model is Llama 3's debug shape (dim 256, 6 layers, 16 heads, SwiGLU 768, vocabulary 2048,
6,163,712 parameters in both), local batch 8 x 256 tokens per data-parallel rank, no compile, no
activation checkpointing, and torchtitan's debug recipe in both: AdamW lr 8e-4, betas (0.9,
0.95), eps 1e-8, weight decay 0.1, clip 1.0, 2 linear warm-up steps then linear decay to 0 over
the last 80% of steps, seed 42, unshuffled data, document-causal attention (titanlite's
`model.document_masking`; torchtitan also restarts RoPE positions at each document, titanlite
does not: no cost either way), scaled RoPE theta 500000, fp32 gradient reduction. Each keeps
its own kernels' choices (torchtitan: fused AdamW, chunked loss; titanlite: fused AdamW,
foreach before ab00108, the loss unchunked at this size). Configs:

    dp1_fp32, dp1_bf16      one process, 2 threads (on one rank torchtitan always wraps the model
                            in a 1-rank FSDP for its precision policy; titanlite does for bf16)
    fsdp2_fp32, fsdp2_bf16  FSDP over 2 processes, 1 thread each
    bf16 = mixed precision: titanlite's --training.mixed_precision_param bfloat16, torchtitan's
    --training.mixed-precision-param bfloat16 (bf16 compute, fp32 parameters and reductions).

Both frameworks train on one local JSON-lines file in C4's schema ({"text", "timestamp", "url"}),
`--data`, or `--docs` documents cut from the Python standard library's sources by
scripts/benchmarks/bench_data.py's write_corpus into OUT/corpus.jsonl when that is absent.
Tokenizers differ: torchtitan uses its bundled test tokenizer
(tests/assets/tokenizer/tokenizer.json, a Hugging Face BPE file), which titanlite cannot read (it
reads tiktoken encodings and tiktoken BPE rank files), so titanlite uses its debug vocabulary, the
first 2,043 BPE ranks of cl100k and its 5 special tokens (2,048 ids, the same embedding and output
shapes). The same text is therefore different token streams: losses are each framework's own and are
not compared, only throughput is. Each framework launches through torchrun (--standalone),
torchtitan through scripts/benchmarks/torchtitan_cpu.py, which replaces at run time the functions of
torchtitan that fail on a CPU (see its docstring) without changing its files.

Measurement: runs alternate titanlite, torchtitan, titanlite, ... (each repeat runs every
config, both frameworks), `--repeats` times. This process reads each run's console as it comes
and stamps every line with its arrival time; rank 0's step lines give, per run, the global
tokens/s over steps 6..`--steps` (tokens of those steps over the time from step 5's line to the
last one's; start-up, step 1's compiles and steps 2-5 are warm-up). Reported per config: the
median over repeats of each framework, titanlite/torchtitan, and each framework's losses at
steps 1, `--steps` - 5 and `--steps` (1/20/25 by default). Written to OUT: results.md (the
table), results.csv (one row per run), results.json (runs, summary, commits), logs/ (each run's
stamped console). The last line printed is `RESULT {json}`: per config each framework's median
and the ratio. Runs on a shared machine are noisy (12-18% run to run on a 2-core VM): compare
medians of >= 3 interleaved repeats and trust only differences well above that.

Setting torchtitan up (outside this repository; a few minutes, once):

    git clone https://github.com/pytorch/torchtitan /work/scratch/torchtitan
    git -C /work/scratch/torchtitan checkout b5bcd76c66d0acb1a08b176d9639425bc55e0b2a
    python3 -m venv /work/scratch/tt-venv
    /work/scratch/tt-venv/bin/pip install torch==2.13.0     # the CPU wheel where that is local;
    #   name the version: a bare `torch` may pull a multi-GB CUDA build
    /work/scratch/tt-venv/bin/pip install grain==0.2.18 "datasets<4.8" tensorboard tyro \\
        tokenizers safetensors einops pillow spmd_types==0.2.3 torch_checkpointing triton
    # triton is imported unconditionally by torchtitan (never used on CPU). Its
    # tests/assets/c4_test/data.json is not needed: the bench brings its own data.

This script itself runs in titanlite's environment (`python` with titanlite's dependencies);
the titanlite runs use the same interpreter.
"""

import argparse
import contextlib
import csv
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "scripts" / "benchmarks" / "torchtitan_cpu.py"
PINNED_COMMIT = "b5bcd76c66d0acb1a08b176d9639425bc55e0b2a"  # scripts/benchmarks/torchtitan_cpu.py's
FRAMEWORKS = ("titanlite", "torchtitan")
# name -> (processes, threads per process, compute dtype)
CONFIGS = {
    "dp1_fp32": (1, 2, "float32"),
    "dp1_bf16": (1, 2, "bfloat16"),
    "fsdp2_fp32": (2, 1, "float32"),
    "fsdp2_bf16": (2, 1, "bfloat16"),
}
LOCAL_BATCH, SEQ_LEN = 8, 256
WARMUP_STEPS = 5  # steps 1..5 are not measured
# The cl100k ranks titanlite keeps: with its 5 special tokens, 2,048 ids (torchtitan's vocab).
TITANLITE_VOCAB_LIMIT = 2043

# Step lines, after any ANSI colours are dropped:
#   titanlite:  "[r0] 13:54:27 INFO step     1  loss  8.2160  grad_norm 0.638  ...  wps 347  ..."
#   torchtitan: "[titan] ... - INFO - step:  1  loss:  8.03677  grad_norm: ...  tps: 43  ..."
_STEP = {
    "titanlite": re.compile(r"\bstep\s+(\d+)\s+loss\s+(\S+).*?\bwps\s+([\d,.]+)"),
    "torchtitan": re.compile(r"\bstep:\s*(\d+)\s+loss:\s*(\S+).*?\btps:\s*([\d,.]+)"),
}
PARAMS = {
    "titanlite": re.compile(r"([\d,]+) parameters, vocab (\d+)"),
    "torchtitan": re.compile(r"size: ([\d,]+) total parameters"),
}
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_step_line(framework: str, line: str) -> tuple[int, float, float] | None:
    """(step, loss, the framework's own tokens/s per device) from a step line, else None."""
    m = _STEP[framework].search(ANSI.sub("", line))
    if not m:
        return None
    return int(m[1]), float(m[2]), float(m[3].replace(",", ""))


def parse_run(framework: str, stamped: list[tuple[float, str]]) -> dict:
    """A run's stamped console -> {"steps": {step: (time, loss, own_tps)}, "params": int|None}.
    A step logged twice keeps its first line."""
    steps, params = {}, None
    for t, line in stamped:
        if (parsed := parse_step_line(framework, line)) is not None:
            step, loss, own = parsed
            steps.setdefault(step, (t, loss, own))
        elif params is None and (m := PARAMS[framework].search(line)):
            params = int(m[1].replace(",", ""))
    return {"steps": steps, "params": params}


def window_rate(steps: dict, last: int, tokens_per_step: int) -> float:
    """Global tokens/s over steps WARMUP_STEPS+1..last: their tokens over the time from step
    WARMUP_STEPS's line to step last's."""
    start, end = steps[WARMUP_STEPS][0], steps[last][0]
    if end <= start:
        raise ValueError(f"step {last}'s line is not after step {WARMUP_STEPS}'s")
    return (last - WARMUP_STEPS) * tokens_per_step / (end - start)


def loss_steps(last: int) -> list[int]:
    """The steps whose losses are reported: 1, last - 5, last (1/20/25 for 25 steps)."""
    return sorted({1, max(1, last - 5), last})


def measure(framework: str, stamped, last: int, tokens_per_step: int) -> dict:
    """A run's figures: global tokens/s over the window, the losses reported, the framework's
    own median per-device tokens/s over the window, the parameter count; or an error."""
    run = parse_run(framework, stamped)
    steps = run["steps"]
    missing = [s for s in (WARMUP_STEPS, *loss_steps(last), last) if s not in steps]
    if missing:
        return {"error": f"no step line for step(s) {sorted(set(missing))}", **run}
    window = range(WARMUP_STEPS + 1, last + 1)
    return {
        "tokens_per_s": window_rate(steps, last, tokens_per_step),
        "losses": {s: steps[s][1] for s in loss_steps(last)},
        "own_tps_median": statistics.median(steps[s][2] for s in window if s in steps),
        "params": run["params"],
    }


def summarize(runs: list[dict], configs: list[str]) -> dict:
    """Per config and framework: the median tokens/s over the runs that finished, how many
    did, the losses of the first (and whether another repeat's differ); and the ratio
    titanlite/torchtitan of the medians."""
    out = {}
    for c in configs:
        row = {}
        for fw in FRAMEWORKS:
            done = [
                r for r in runs if r["config"] == c and r["framework"] == fw and "error" not in r
            ]
            failed = sum(1 for r in runs if r["config"] == c and r["framework"] == fw) - len(done)
            rates = [r["tokens_per_s"] for r in done]
            row[fw] = {
                "median": statistics.median(rates) if rates else None,
                "runs": rates,
                "failed": failed,
                "losses": done[0]["losses"] if done else None,
                "losses_vary": any(r["losses"] != done[0]["losses"] for r in done),
                "params": done[0]["params"] if done else None,
            }
        tl, tt = row["titanlite"]["median"], row["torchtitan"]["median"]
        row["ratio"] = tl / tt if tl and tt else None
        out[c] = row
    return out


def _fmt_rate(cell: dict) -> str:
    if cell["median"] is None:
        return f"failed ({cell['failed']})"
    runs = " / ".join(f"{r:,.0f}" for r in cell["runs"])
    failed = f", {cell['failed']} failed" if cell["failed"] else ""
    return f"{cell['median']:,.0f} ({runs}{failed})"


def _fmt_losses(cell: dict) -> str:
    if not cell["losses"]:
        return "-"
    text = " / ".join(
        f"{v:.4f}" for _, v in sorted(cell["losses"].items(), key=lambda kv: int(kv[0]))
    )
    return text + (" (vary)" if cell["losses_vary"] else "")


def markdown_table(summary: dict, last: int) -> str:
    at = "/".join(f"@{s}" for s in loss_steps(last))
    lines = [
        f"| config | ranks x threads | titanlite global tok/s, median (runs) | torchtitan global "
        f"tok/s, median (runs) | titanlite / torchtitan | titanlite loss {at} | torchtitan loss "
        f"{at} |",
        "|---|---|---|---|---|---|---|",
    ]
    for c, row in summary.items():
        procs, threads, _ = CONFIGS[c]
        ratio = f"{row['ratio']:.2f}" if row["ratio"] else "-"
        lines.append(
            f"| {c} | {procs} x {threads} | {_fmt_rate(row['titanlite'])} | "
            f"{_fmt_rate(row['torchtitan'])} | {ratio} | {_fmt_losses(row['titanlite'])} | "
            f"{_fmt_losses(row['torchtitan'])} |"
        )
    return "\n".join(lines)


def result_line(summary: dict) -> str:
    """`RESULT {json}`: per config each framework's median tokens/s and the ratio."""
    compact = {
        c: {
            "titanlite": row["titanlite"]["median"] and round(row["titanlite"]["median"], 1),
            "torchtitan": row["torchtitan"]["median"] and round(row["torchtitan"]["median"], 1),
            "ratio": row["ratio"] and round(row["ratio"], 4),
        }
        for c, row in summary.items()
    }
    return "RESULT " + json.dumps(compact, separators=(",", ":"))


# ------------------------------------------------------------------ commands
def titanlite_cmd(config: str, steps: int, corpus: Path, dump: Path, cache: Path) -> list[str]:
    procs, _, dtype = CONFIGS[config]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
        str(REPO / "train.py"), "--job.config_file", "debug_model.toml",
        "--job.dump_folder", str(dump), "--training.dataset", "local",
        "--training.dataset_path", str(corpus), "--training.data_cache_dir", str(cache),
        "--model.vocab_limit", str(TITANLITE_VOCAB_LIMIT), "--model.document_masking",
        "--model.use_scaled_rope", "--training.steps", str(steps),
        "--training.local_batch_size", str(LOCAL_BATCH), "--training.seq_len", str(SEQ_LEN),
        "--training.mixed_precision_param", dtype, "--training.mixed_precision_reduce", "float32",
        "--optimizer.lr", "8e-4", "--lr_scheduler.warmup_steps", "2",
        "--lr_scheduler.decay_ratio", "0.8", "--lr_scheduler.decay_type", "linear",
        "--lr_scheduler.min_lr_factor", "0", "--activation_checkpoint.mode", "none",
        "--metrics.log_freq", "1", "--no-metrics.enable_tensorboard", "--debug.seed", "42",
    ]  # fmt: skip


def torchtitan_cmd(python: str, config: str, steps: int, corpus: Path, dump: Path) -> list[str]:
    procs, _, dtype = CONFIGS[config]
    return [
        python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
        str(SHIM), "--data-file", str(corpus), "--",
        "--module", "llama3", "--config", "llama3_debugmodel", "--dump-folder", str(dump),
        "--training.steps", str(steps),
        "--training.num-tokens-per-microbatch-per-dp-rank", str(LOCAL_BATCH * SEQ_LEN),
        "--training.max-context-length", str(SEQ_LEN), "--validator.no-enable",
        "--checkpoint.no-enable", "--compile.no-enable", "--metrics.log-freq", "1",
        "--metrics.disable-color-printing", "--debug.seed", "42",
        "--parallelism.spmd-backend", "partial_dtensor",  # the default fails FSDP on torch 2.13
        "--training.mixed-precision-param", dtype, "activation-checkpoint:none",
    ]  # fmt: skip


def run_stamped(cmd, cwd, env, log: Path, timeout_s: float) -> tuple[int, list[tuple[float, str]]]:
    """Run `cmd` in its own process group, stamping each console line with seconds since the
    start as it arrives; kill the group after `timeout_s`. The stamped lines also go to `log`."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        errors="replace", start_new_session=True,
    )  # fmt: skip

    def kill():
        with contextlib.suppress(ProcessLookupError):  # it ended as the timer fired
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    stamped = []
    try:
        with open(log, "w", buffering=1) as out:  # line by line: a run can be watched
            for line in proc.stdout:
                t = time.perf_counter() - start
                stamped.append((t, line.rstrip("\n")))
                out.write(f"{t:10.3f} {line}")
        rc = proc.wait()
    finally:
        timer.cancel()
    return rc, stamped


def git_commit(path: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options, checked: a bad one exits with one line and code 2."""
    ap = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__.split("\n\n")[0])
    ap.add_argument("--torchtitan", required=True, help="a torchtitan checkout (see the setup)")
    ap.add_argument("--torchtitan-python", required=True,
                    help="python of the venv with torchtitan's dependencies")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=3, help="runs per config and framework")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of: "
                    + ", ".join(CONFIGS))  # fmt: skip
    ap.add_argument("--steps", type=int, default=25, help=f"steps per run (>= {WARMUP_STEPS + 2})")
    ap.add_argument("--out", default="outputs/bench_torchtitan", help="folder for the results")
    ap.add_argument("--data", default="", help="JSON-lines corpus (default: OUT/corpus.jsonl, "
                    "written if absent)")  # fmt: skip
    ap.add_argument("--docs", type=int, default=2000, help="documents of a written corpus")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds before a run is killed")
    args = ap.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if unknown := [c for c in args.configs if c not in CONFIGS]:
        ap.error(f"unknown config(s) {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
    if not args.configs:
        ap.error("--configs names no config")
    if args.repeats < 1 or args.docs < 1 or args.timeout <= 0:
        ap.error("--repeats, --docs and --timeout must be positive")
    if args.steps < WARMUP_STEPS + 2:
        ap.error(f"--steps must be at least {WARMUP_STEPS + 2}: steps 1-{WARMUP_STEPS} are "
                 f"warm-up, the rate needs two steps after them")  # fmt: skip
    args.checkout = Path(args.torchtitan).expanduser().resolve()
    if not args.checkout.is_dir():
        ap.error(f"--torchtitan {args.torchtitan!r} is not a folder")
    if not (args.checkout / "torchtitan" / "train.py").is_file():
        ap.error(f"--torchtitan {args.torchtitan!r} is not a torchtitan checkout "
                 "(no torchtitan/train.py in it)")  # fmt: skip
    tt_python = Path(args.torchtitan_python).expanduser()
    if not (tt_python.is_file() and os.access(tt_python, os.X_OK)):
        ap.error(f"--torchtitan-python {args.torchtitan_python!r} is not an executable file")
    args.torchtitan_python = str(tt_python)
    if args.data and not Path(args.data).is_file():
        ap.error(f"--data {args.data!r} is not a file")
    return args


def run_one(args, config: str, fw: str, rep: int, corpus: Path, out: Path, envs: dict) -> dict:
    """One run of `fw` on `config`: its figures (measure()) or an error, with its exit code."""
    procs, threads, _ = CONFIGS[config]
    tag = f"{config}_{fw}_r{rep}"
    dump = out / "runs" / tag
    if fw == "titanlite":
        cmd, cwd = titanlite_cmd(config, args.steps, corpus, dump, out / "cache"), REPO
    else:
        cmd = torchtitan_cmd(args.torchtitan_python, config, args.steps, corpus, dump)
        cwd = args.checkout  # its config names ./tests/assets/tokenizer
    env = dict(envs[fw], OMP_NUM_THREADS=str(threads))
    t0 = time.perf_counter()
    rc, stamped = run_stamped(cmd, cwd, env, out / "logs" / f"{tag}.log", args.timeout)
    record = {"config": config, "framework": fw, "repeat": rep, "returncode": rc,
              "wall_s": time.perf_counter() - t0, "log": f"logs/{tag}.log"}  # fmt: skip
    record |= measure(fw, stamped, args.steps, LOCAL_BATCH * SEQ_LEN * procs)
    record.pop("steps", None)
    return with_error(record, rc, stamped)


def with_error(record: dict, rc: int, stamped: list) -> dict:
    """A run's record with its error, if any, naming the exit code and the log's last line."""
    if rc != 0 and "error" not in record:
        record["error"] = f"exit code {rc}"
    if "error" in record:
        tail = stamped[-1][1] if stamped else "no output"
        record["error"] += f"; exit code {rc}; last line: {tail}"
    return record


def write_results(out: Path, meta: dict, runs: list[dict], configs: list[str], steps: int) -> str:
    """results.md, .json and .csv in `out`; returns the markdown table."""
    summary = summarize(runs, configs)
    table = markdown_table(summary, steps)
    (out / "results.md").write_text(table + "\n")
    (out / "results.json").write_text(
        json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1) + "\n"
    )
    with open(out / "results.csv", "w", newline="") as f:
        fields = ["config", "framework", "repeat", "tokens_per_s", "own_tps_median", "params",
                  *(f"loss_{s}" for s in loss_steps(steps)), "returncode", "wall_s",
                  "error", "log"]  # fmt: skip
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in runs:
            w.writerow(r | {f"loss_{s}": v for s, v in (r.get("losses") or {}).items()})
    return table


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_DATASETS_CACHE=str(out / "hf_datasets"),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")  # fmt: skip
    envs = {"titanlite": env, "torchtitan": dict(env, PYTHONPATH=str(args.checkout))}
    check = subprocess.run([args.torchtitan_python, str(SHIM), "--check"], cwd=args.checkout,
                           env=envs["torchtitan"], capture_output=True, text=True)  # fmt: skip
    if check.returncode != 0:
        last = (check.stderr.strip() or check.stdout.strip() or "no output").splitlines()[-1]
        print(f"bench_torchtitan: torchtitan does not start with {args.torchtitan_python}: "
              f"{last}", file=sys.stderr)  # fmt: skip
        return 2
    corpus = Path(args.data).resolve() if args.data else out / "corpus.jsonl"
    if not corpus.is_file():
        from bench_data import write_corpus  # this folder; imports titanlite's data modules

        write_corpus(corpus, args.docs, 2000, c4_fields=True)
    meta = {
        "torchtitan_commit": git_commit(args.checkout),
        "shim_written_against": PINNED_COMMIT,
        "titanlite_commit": git_commit(REPO),
        "corpus": str(corpus),
        "steps": args.steps,
        "measured_steps": [WARMUP_STEPS + 1, args.steps],
        "cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
    }
    print(f"titanlite {meta['titanlite_commit'][:12]} vs torchtitan "
          f"{meta['torchtitan_commit'][:12]}; corpus {corpus}; {args.repeats} repeat(s) of "
          f"{', '.join(args.configs)}; {args.steps} steps, tokens/s over steps "
          f"{WARMUP_STEPS + 1}-{args.steps}", flush=True)  # fmt: skip
    plan = [(rep, c, fw) for rep in range(1, args.repeats + 1) for c in args.configs
            for fw in FRAMEWORKS]  # fmt: skip
    runs = []
    for n, (rep, config, fw) in enumerate(plan, 1):
        r = run_one(args, config, fw, rep, corpus, out, envs)
        if "error" in r:
            line = f"FAILED: {r['error']}"
        else:
            losses = " / ".join(f"{v:.4f}" for v in r["losses"].values())
            line = f"{r['tokens_per_s']:,.0f} tokens/s, losses {losses}"
        print(f"[{n}/{len(plan)}] {config}_{fw}_r{rep}: {line} ({r['wall_s']:.0f} s)", flush=True)
        runs.append(r)
    table = write_results(out, meta, runs, args.configs, args.steps)
    print(f"\n{table}\n\nWritten: {out}/results.md, results.csv, results.json, logs/")
    print(result_line(summarize(runs, args.configs)))
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
