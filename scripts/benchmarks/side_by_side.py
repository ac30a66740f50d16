"""titanlite beside torchtitan v0.2.2 on the GPU present: the same model, data and settings, run
alternately; tokens/s, peak memory and the ratios.

    # on a GPU: Llama 3 8B's block shape and Llama 3.2 1B, torchtitan 0.2.2 as installed (or
    # --torchtitan SRC, a folder holding its package; --pythonpath for its packages; the offline
    # setup is in docs/rehearsal.md)
    python scripts/benchmarks/side_by_side.py --shapes 8B_4L,1B
    # on a CPU, the plumbing in seconds (the suite runs it)
    python scripts/benchmarks/side_by_side.py --cpu-smoke

Shapes: `8B_4L` (Llama 3 8B's args with 4 layers) and `1B` (Llama 3.2 1B, untied). Each is
titanlite's flavor; torchtitan gets the same shape as a flavor added through its own
`--experimental.custom_import` (side_by_side_flavor.py), built from titanlite's model args:
dim, layers, heads, KV heads, SwiGLU width, norm eps, RoPE theta and vocabulary size equal (the
output layer is 3-7% of these models' FLOPs). Both read the same tokenizer (titanlite's, written
as tokenizer.json for torchtitan) and the same JSON-lines file; the parameter counts of both logs
are compared (`params_match`). Settings, each framework's own spelling: 1 x 8,192 tokens, compile
(torchtitan's model and loss components; titanlite's blocks and its plain loss,
--loss.chunk_tokens 0), selective activation checkpointing recomputing every second matmul
(torchtitan's `op` = titanlite's `op_alternate`), bf16 compute, RoPE scaling (torchtitan always
scales), metrics every step, no checkpoints. Left as each framework has them: on one GPU
torchtitan keeps fp32 parameters under bf16 autocast, titanlite a one-rank FSDP2 with bf16
parameters over fp32 masters; torchtitan's allocator setting from its run script
(expandable_segments), titanlite's own default (the same).

Measurement: runs alternate (titanlite first in odd repeats, torchtitan first in even ones).
This process stamps each console line as it arrives; a step's tokens/s is its tokens over the
time since the previous step's line, and a run's figure is the median over steps 6..--steps
(step 1 compiles; 2-5 warm up). Also kept: each framework's own per-step figure (median over the
same steps) and its peak memory, the largest `memory`/`mem` it logged (CUDA's peak reserved; on a
CPU the process's peak RSS). Per shape: the median over repeats, titanlite / torchtitan for
tokens/s and memory, and whether the goal holds (>= 1.10x tokens/s at no more memory).
Written to --out after every run: side_by_side.md (the table), side_by_side.json (settings,
runs, summary), logs/ (each run's console, stamped), runs/ (each run's dump folder).

--cpu-smoke: titanlite's debugmodel with 2 layers, vocabulary 640, 1 x 128 tokens, 7 steps
(steps 6-7 measured), fp32, no compile, gloo; torchtitan through side_by_side_cpu.py.
"""

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_torchtitan import ANSI, PARAMS, git_commit, run_stamped, with_error  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "scripts" / "benchmarks"
FRAMEWORKS = ("titanlite", "torchtitan")
WARMUP_STEPS = 5
MIN_RUN_S = 30  # --budget: a run needs its start-up and its steps
GOAL_RATIO = 1.10
FLAVOR = "side_by_side"  # side_by_side_flavor.FLAVOR (that module imports torchtitan)
FLAVOR_ENV = "TITANLITE_SIDE_BY_SIDE_ARGS"


@dataclass(frozen=True)
class Shape:
    flavor: str  # titanlite's
    vocab_limit: int  # titanlite's model.vocab_limit (0: all of cl100k, 100,352 padded)
    seq_len: int


SHAPES = {"8B_4L": Shape("8B_4L", 0, 8192), "1B": Shape("1B", 0, 8192)}
SMOKE_SHAPE = {"smoke": Shape("debugmodel_2L", 512, 128)}

# Step lines after ANSI colours are dropped:
#   titanlite:  "... INFO step     6  loss  8.2001  grad_norm  1.5  ...  wps 100  ...  mem 0.56GiB"
#   torchtitan: "... INFO - step:  6  loss:  8.13958  ...  memory:  0.50GiB(2.11%)  tps: 830"
STEP_LINE = {
    "titanlite": re.compile(
        r"\bstep\s+(?P<step>\d+)\s+loss\s+(?P<loss>\S+).*?\bwps\s+(?P<tps>[\d,.]+)"
        r".*?\bmem\s+(?P<mem>[\d.]+)GiB"
    ),
    "torchtitan": re.compile(
        r"\bstep:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+).*?\bmemory:\s*(?P<mem>[\d.]+)GiB"
        r".*?\btps:\s*(?P<tps>[\d,.]+)"
    ),
}


def parse_console(framework: str, stamped: list[tuple[float, str]]) -> dict:
    """{"steps": {step: {"t", "loss", "tps", "mem"}}, "params": int | None} from a run's stamped
    console; a step logged twice keeps its first line."""
    steps, params = {}, None
    for t, line in stamped:
        line = ANSI.sub("", line)
        if m := STEP_LINE[framework].search(line):
            entry = {"t": t, "loss": float(m["loss"]), "tps": float(m["tps"].replace(",", "")),
                     "mem": float(m["mem"])}  # fmt: skip
            steps.setdefault(int(m["step"]), entry)
        elif params is None and (m := PARAMS[framework].search(line)):
            params = int(m[1].replace(",", ""))
    return {"steps": steps, "params": params}


def measure(framework: str, stamped, last: int, tokens_per_step: int) -> dict:
    """A run's figures: median tokens/s over steps WARMUP_STEPS+1..last from the arrival times,
    the framework's own median, its peak memory, its parameter count; or an error."""
    run = parse_console(framework, stamped)
    steps = run["steps"]
    if missing := [s for s in range(WARMUP_STEPS, last + 1) if s not in steps]:
        return {"error": f"no step line for step(s) {missing}", "params": run["params"]}
    window = range(WARMUP_STEPS + 1, last + 1)
    gaps = [steps[s]["t"] - steps[s - 1]["t"] for s in window]
    if min(gaps) <= 0:
        return {"error": "two step lines arrived together: the console is buffered"}
    return {
        "tokens_per_s": statistics.median(tokens_per_step / g for g in gaps),
        "own_tokens_per_s": statistics.median(steps[s]["tps"] for s in window),
        "peak_gib": max(v["mem"] for v in steps.values()),
        "loss_last": steps[last]["loss"],
        "params": run["params"],
    }


def summarize(runs: list[dict], shapes: list[str]) -> dict:
    """Per shape: each framework's medians over the runs that finished, and the ratios."""
    out = {}
    for shape in shapes:
        row = {}
        for fw in FRAMEWORKS:
            mine = [r for r in runs if r["shape"] == shape and r["framework"] == fw]
            done = [r for r in mine if "error" not in r]
            row[fw] = {
                "tokens_per_s": _median(r["tokens_per_s"] for r in done),
                "own_tokens_per_s": _median(r["own_tokens_per_s"] for r in done),
                "peak_gib": _median(r["peak_gib"] for r in done),
                "runs": [round(r["tokens_per_s"], 1) for r in done],
                "failed": len(mine) - len(done),
                "params": done[0]["params"] if done else None,
            }
        tl, tt = row["titanlite"], row["torchtitan"]
        both = tl["tokens_per_s"] is not None and tt["tokens_per_s"] is not None
        row["ratio"] = tl["tokens_per_s"] / tt["tokens_per_s"] if both else None
        row["memory_ratio"] = tl["peak_gib"] / tt["peak_gib"] if both and tt["peak_gib"] else None
        row["params_match"] = tl["params"] == tt["params"] if both else None
        row["goal_met"] = (
            row["ratio"] >= GOAL_RATIO and row["memory_ratio"] <= 1.0
            if row["ratio"] is not None and row["memory_ratio"] is not None
            else None
        )
        out[shape] = row
    return out


def _median(values):
    values = list(values)
    return statistics.median(values) if values else None


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown_table(summary: dict) -> str:
    lines = [
        "| shape | params (titanlite / torchtitan) | titanlite tok/s | torchtitan tok/s | "
        "titanlite / torchtitan | titanlite peak GiB | torchtitan peak GiB | memory ratio | "
        f"goal (>= {GOAL_RATIO:.2f}x, no more memory) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for shape, row in summary.items():
        tl, tt = row["titanlite"], row["torchtitan"]
        params = f"{_cell(tl['params'], ',')} / {_cell(tt['params'], ',')}"
        if row["params_match"] is False:
            params += " (differ)"
        rates = [_cell(c["tokens_per_s"], ",.0f") + (f" ({c['failed']} failed)" if c["failed"]
                 else "") for c in (tl, tt)]  # fmt: skip
        goal = {True: "met", False: "not met", None: "-"}[row["goal_met"]]
        lines.append(
            f"| {shape} | {params} | {rates[0]} | {rates[1]} | {_cell(row['ratio'], '.3f')} | "
            f"{_cell(tl['peak_gib'], '.2f')} | {_cell(tt['peak_gib'], '.2f')} | "
            f"{_cell(row['memory_ratio'], '.3f')} | {goal} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ the two commands
def titanlite_args(shape: Shape, smoke: bool, steps: int, data: Path) -> list[str]:
    """train.py's options for `shape` (also read here for the model args torchtitan gets)."""
    args = [
        "--job.config_file", "debug_model.toml", "--model.flavor", shape.flavor,
        "--model.vocab_limit", str(shape.vocab_limit), "--model.use_scaled_rope",
        "--training.seq_len", str(shape.seq_len), "--training.local_batch_size", "1",
        "--training.steps", str(steps), "--training.dataset", "local",
        "--training.dataset_path", str(data / "data.json"),
        "--training.data_cache_dir", str(data.parent / "titanlite_cache"),  # data/: data.json alone
        "--activation_checkpoint.mode", "selective",
        "--activation_checkpoint.selective_ac_option", "op_alternate",
        "--metrics.log_freq", "1", "--no-metrics.enable_tensorboard",
    ]  # fmt: skip
    if smoke:  # a peak skips the CPU's matmul calibration at start-up
        return [*args, "--training.mixed_precision_param", "float32", "--metrics.peak_tflops", "1"]
    return [*args, "--training.mixed_precision_param", "bfloat16", "--compile.enable",
            "--loss.chunk_tokens", "0"]  # fmt: skip


def torchtitan_args(shape: Shape, smoke: bool, steps: int, data: Path, tokenizer: Path,
                    dump: Path) -> list[str]:  # fmt: skip
    args = [
        "--model.name", "llama3", "--model.flavor", FLAVOR,
        "--experimental.custom_import", "side_by_side_flavor",
        "--model.hf_assets_path", str(tokenizer),
        "--training.dataset", "c4_test", "--training.dataset_path", str(data),
        "--training.seq_len", str(shape.seq_len), "--training.local_batch_size", "1",
        "--training.steps", str(steps),
        "--activation_checkpoint.mode", "selective",
        "--activation_checkpoint.selective_ac_option", "op",
        "--metrics.log_freq", "1", "--metrics.disable_color_printing",
        "--comm.trace_buf_size", "0", "--checkpoint.no_enable", "--debug.seed", "42",
        "--job.dump_folder", str(dump),
    ]  # fmt: skip
    if smoke:
        return [*args, "--training.mixed_precision_param", "float32"]
    return [*args, "--training.mixed_precision_param", "bfloat16", "--compile.enable"]


def torchtitan_shape(titanlite_argv: list[str]) -> dict:
    """torchtitan's TransformerModelArgs fields for the model titanlite builds from its options,
    and titanlite's tokenizer (for torchtitan to read the same token ids)."""
    from titanlite.build import model_args_for
    from titanlite.config_parse import parse_args
    from titanlite.data.tokenizer import build_tokenizer

    cfg = parse_args(titanlite_argv)
    tokenizer = build_tokenizer(cfg.model)
    a = model_args_for(cfg, tokenizer)
    if not a.use_scaled_rope or a.qk_norm or a.tie_embeddings or a.document_masking:
        raise ValueError(f"{cfg.model.flavor}: not a shape torchtitan's llama3 builds alike")
    fields = {"dim": a.dim, "n_layers": a.n_layers, "n_heads": a.n_heads,
              "n_kv_heads": a.n_kv_heads, "vocab_size": a.vocab_size,
              "multiple_of": a.multiple_of, "ffn_dim_multiplier": a.ffn_dim_multiplier,
              "norm_eps": a.norm_eps, "rope_theta": a.rope_theta}  # fmt: skip
    return {"fields": fields, "tokenizer": tokenizer, "ffn_hidden": a.ffn_hidden_dim}


def write_tokenizer(tokenizer, folder: Path, max_len: int) -> Path:
    """titanlite's tokenizer as the Hugging Face files torchtitan reads (hf_assets_path)."""
    from titanlite.hf_export import write_tokenizer_files

    if not (folder / "tokenizer.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        write_tokenizer_files(folder, tokenizer, "", max_len)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(python: str, smoke: bool, target: list[str]) -> tuple[list[str], dict]:
    """One process on the GPU through torchrun (as both frameworks document); in the smoke mode
    the process itself with a one-rank rendezvous in its environment (no launcher to start)."""
    if smoke:
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # fmt: skip
        return [python, *target], env
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
            *target], {}  # fmt: skip


# ------------------------------------------------------------------ options and the runs
def parse_options(argv: list[str] | None) -> argparse.Namespace:
    """The options, checked: a bad one exits with one line and code 2."""
    ap = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__.split("\n\n")[0])
    ap.add_argument("--torchtitan", default="", help="folder holding torchtitan v0.2.2's "
                    "package (a source archive); default: the installed one")  # fmt: skip
    ap.add_argument("--python", default=sys.executable, help="python that runs torchtitan")
    ap.add_argument("--pythonpath", default="", help="extra folders for torchtitan's packages "
                    "(os.pathsep-separated), ahead of PYTHONPATH")  # fmt: skip
    ap.add_argument("--shapes", default=None, help="comma-separated, of: " + ", ".join(SHAPES))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shape on the CPU, seconds")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 25; smoke 7)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per shape and framework")
    ap.add_argument("--docs", type=int, default=None,
                    help="documents (4,000 characters each) of the corpus written (default 1000; "
                    "smoke 100)")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=300, help="seconds before a run is killed")
    ap.add_argument("--budget", type=float, default=0, help="seconds for the whole script (0: no "
                    "limit): a run is cut to what is left, and none starts with under "
                    f"{MIN_RUN_S:.0f} s left")  # fmt: skip
    ap.add_argument("--out", default="outputs/side_by_side", help="folder for the results")
    args = ap.parse_args(argv)
    if args.cpu_smoke and args.shapes is not None:
        ap.error("--shapes does not apply to --cpu-smoke (it runs one tiny shape)")
    names = [s.strip() for s in (args.shapes or ",".join(SHAPES)).split(",") if s.strip()]
    if unknown := [s for s in names if s not in SHAPES]:
        ap.error(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    if not names:
        ap.error("--shapes names no shape")
    args.shapes = SMOKE_SHAPE if args.cpu_smoke else {s: SHAPES[s] for s in names}
    args.steps = args.steps or (WARMUP_STEPS + 2 if args.cpu_smoke else 25)
    args.docs = args.docs or (100 if args.cpu_smoke else 1000)
    if args.steps < WARMUP_STEPS + 2:
        ap.error(f"--steps must be at least {WARMUP_STEPS + 2}: steps 1-{WARMUP_STEPS} are "
                 "warm-up, the median needs steps after them")  # fmt: skip
    if args.repeats < 1 or args.docs < 1 or args.timeout <= 0 or args.budget < 0:
        ap.error("--repeats, --docs and --timeout must be positive, --budget not negative")
    if args.torchtitan and not (Path(args.torchtitan) / "torchtitan" / "train.py").is_file():
        ap.error(f"--torchtitan {args.torchtitan!r} holds no torchtitan/train.py: pass the folder "
                 "that holds the torchtitan package (a v0.2.2 source archive)")  # fmt: skip
    if not (Path(args.python).is_file() and os.access(args.python, os.X_OK)):
        ap.error(f"--python {args.python!r} is not an executable file")
    extra = [p for p in args.pythonpath.split(os.pathsep) if p]
    if missing := [p for p in extra if not Path(p).is_dir()]:
        ap.error(f"--pythonpath {', '.join(missing)}: not a folder")
    args.pythonpath = [str(Path(p).resolve()) for p in extra]
    return args


def torchtitan_env(args, base: dict) -> dict:
    paths = [*([str(Path(args.torchtitan).resolve())] if args.torchtitan else []),
             *args.pythonpath, str(BENCH), base.get("PYTHONPATH", "")]  # fmt: skip
    env = dict(base, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    return env | {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}  # its run script's setting


def torchtitan_version(python: str, env: dict) -> tuple[str, str]:
    """(version, package folder) of the torchtitan that `python` imports, without importing it
    (which imports torch); a folder without installed metadata reads its assets/version.txt."""
    probe = "\n".join([
        "import importlib.util as u, importlib.metadata as m, pathlib, sys",
        "s = u.find_spec('torchtitan')",
        "if s is None: sys.exit('no torchtitan package')",
        "p = pathlib.Path(s.origin).parent",
        "v = p.parent / 'assets' / 'version.txt'",
        "print(v.read_text().strip() if v.is_file() else m.version('torchtitan'), p)",
    ])  # fmt: skip
    out = subprocess.run([python, "-c", probe], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        last = (out.stderr.strip() or out.stdout.strip() or "no output").splitlines()[-1]
        raise RuntimeError(
            f"{python} does not find torchtitan ({last}): install torchtitan==0.2.2 "
            "(pip install -e '.[torchtitan]') or pass --torchtitan and --pythonpath"
        )
    version, folder = out.stdout.split(maxsplit=1)
    return version, folder.strip()


def run_one(args, shape_name: str, fw: str, rep: int, setup: dict, out: Path, timeout: float):
    shape, tag = args.shapes[shape_name], f"{shape_name}_{fw}_r{rep}"
    dump = out / "runs" / tag
    if fw == "titanlite":
        target = [str(REPO / "train.py"), *setup[shape_name]["titanlite_argv"], "--job.dump_folder",
                  str(dump)]  # fmt: skip
        cmd, rendezvous = launch(sys.executable, args.cpu_smoke, target)
        env = setup["env"]
    else:
        tt = torchtitan_args(shape, args.cpu_smoke, args.steps, setup["data"],
                             setup[shape_name]["tokenizer_dir"], dump)  # fmt: skip
        entry = ["-m", "torchtitan.train"]  # its own entry point, as its docs launch it
        if args.cpu_smoke:
            entry = [str(BENCH / "side_by_side_cpu.py")]
        cmd, rendezvous = launch(args.python, args.cpu_smoke, [*entry, *tt])
        env = dict(setup["tt_env"], **{FLAVOR_ENV: json.dumps(setup[shape_name]["fields"])})
    t0 = time.perf_counter()
    log = out / "logs" / f"{tag}.log"
    rc, stamped = run_stamped(cmd, REPO, env | rendezvous, log, timeout)
    record = {"shape": shape_name, "framework": fw, "repeat": rep, "returncode": rc,
              "wall_s": round(time.perf_counter() - t0, 1), "log": f"logs/{tag}.log",
              "command": cmd}  # fmt: skip
    record |= measure(fw, stamped, args.steps, shape.seq_len)
    return with_error(record, rc, stamped)


def prepare(args, out: Path, env: dict) -> dict:
    """The corpus (data/data.json, read by both), and per shape titanlite's options, the shape
    torchtitan gets and titanlite's tokenizer as tokenizer.json."""
    from bench_data import write_corpus  # this folder; imports titanlite's data modules

    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    if not (data / "data.json").is_file():
        write_corpus(data / "data.json", args.docs, 4000, c4_fields=True)
    setup = {"data": data, "env": env, "tt_env": torchtitan_env(args, env)}
    for name, shape in args.shapes.items():
        argv = titanlite_args(shape, args.cpu_smoke, args.steps, data)
        found = torchtitan_shape(argv)
        folder = write_tokenizer(
            found["tokenizer"], out / f"tokenizer_limit{shape.vocab_limit}", shape.seq_len
        )
        setup[name] = {"titanlite_argv": argv, "fields": found["fields"],
                       "ffn_hidden": found["ffn_hidden"], "tokenizer_dir": folder}  # fmt: skip
    return setup


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def write_results(out: Path, meta: dict, runs: list[dict], shapes: list[str]) -> str:
    summary = summarize(runs, shapes)
    table = markdown_table(summary)
    (out / "side_by_side.md").write_text(table + "\n")
    payload = {"meta": meta, "summary": summary, "runs": runs}
    (out / "side_by_side.json").write_text(json.dumps(payload, indent=1) + "\n")
    return table


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    args = parse_options(argv)
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("side_by_side: no CUDA device here: run it on a GPU, or --cpu-smoke", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_DATASETS_CACHE=str(out / "hf_datasets"),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")  # fmt: skip
    if args.cpu_smoke:  # the CPU's, a GPU machine's too; one thread: on a busy 2-core machine
        # the spin-waiting threads of two slowed a tiny step 20-fold
        env |= {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    try:
        setup = prepare(args, out, env)
        tt_version, tt_folder = torchtitan_version(args.python, setup["tt_env"])
    except (RuntimeError, ValueError) as e:  # titanlite's ConfigError is a ValueError
        print(f"side_by_side: {e}", file=sys.stderr)
        return 2
    meta = {"device": device_name(), "torch": torch.__version__,
            "titanlite_commit": git_commit(REPO), "torchtitan_version": tt_version,
            "torchtitan_package": tt_folder, "steps": args.steps,
            "measured_steps": [WARMUP_STEPS + 1, args.steps], "cpu_smoke": args.cpu_smoke,
            "shapes": {n: {"titanlite_flavor": s.flavor, "vocab_limit": s.vocab_limit,
                           "seq_len": s.seq_len, "torchtitan_args": setup[n]["fields"],
                           "ffn_hidden": setup[n]["ffn_hidden"]} for n, s in args.shapes.items()},
            "argv": sys.argv if argv is None else argv}  # fmt: skip
    if tt_version != "0.2.2":
        print(f"side_by_side: warning: torchtitan {tt_version}: its options here are v0.2.2's",
              file=sys.stderr)  # fmt: skip
    print(f"titanlite {meta['titanlite_commit'][:12]} vs torchtitan {tt_version} ({tt_folder}) on "
          f"{meta['device']}; {args.repeats} repeat(s) of {', '.join(args.shapes)}; tokens/s: "
          f"median over steps {WARMUP_STEPS + 1}-{args.steps}", flush=True)  # fmt: skip
    shapes, runs = list(args.shapes), []
    plan = [(rep, s, fw) for rep in range(1, args.repeats + 1) for s in shapes
            for fw in (FRAMEWORKS if rep % 2 else FRAMEWORKS[::-1])]  # fmt: skip
    for n, (rep, shape, fw) in enumerate(plan, 1):
        left = args.budget - (time.monotonic() - start) if args.budget else args.timeout
        if left < MIN_RUN_S:
            r = {"shape": shape, "framework": fw, "repeat": rep, "wall_s": 0,
                 "error": f"not run: {max(left, 0):.0f} s of --budget left"}  # fmt: skip
        else:
            r = run_one(args, shape, fw, rep, setup, out, min(args.timeout, left))
        runs.append(r)
        write_results(out, meta, runs, shapes)  # after every run: a killed call keeps its rows
        figure = r["error"] if "error" in r else (
            f"{r['tokens_per_s']:,.0f} tokens/s (own {r['own_tokens_per_s']:,.0f}), peak "
            f"{r['peak_gib']:.2f} GiB")  # fmt: skip
        print(f"[{n}/{len(plan)}] {shape} {fw} r{rep}: {figure} ({r['wall_s']:.0f} s)", flush=True)
    table = write_results(out, meta, runs, shapes)
    print(f"\n{table}\n\nWritten: {out}/side_by_side.md, side_by_side.json, logs/")
    compact = {s: {k: row[k] and round(row[k], 4) for k in ("ratio", "memory_ratio")}
               | {"goal_met": row["goal_met"], "params_match": row["params_match"]}
               for s, row in summarize(runs, shapes).items()}  # fmt: skip
    print("RESULT " + json.dumps(compact, separators=(",", ":")))
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
