"""plan: the fastest layouts of a job on a cluster, predicted; or one layout's figures; or the
model's constants fitted to finished runs.

    python -m titanlite.plan --job.config_file llama_8b.toml --gpus 64 --device h100-sxm
    python -m titanlite.plan --job.config_file llama_8b.toml --gpus 8 --write best.toml
    python -m titanlite.plan --job.config_file llama_8b.toml --gpus 8 --float8   # bf16 and float8
    python -m titanlite.plan --job.config_file llama_8b.toml --gpus 8 --predict
    python -m titanlite.plan --device h200 --calibrate outputs/run_a outputs/run_b ...

Every train.py option is accepted and read as train.py reads it (the model, seq_len, the global
batch: training.global_batch_size, else what the config's own layout gives on --gpus ranks).
"""

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from titanlite.checks import check_options
from titanlite.config import ConfigError
from titanlite.config_parse import dump_toml, parse_args
from titanlite.float8 import float8_enabled
from titanlite.job import World, resolve_job
from titanlite.plan import calibrate
from titanlite.plan.check import dry_run
from titanlite.plan.devices import DEVICES, OVERRIDES, get_device
from titanlite.plan.perf import predict
from titanlite.plan.report import explain, header, rejections, summary, table
from titanlite.plan.search import (
    DEFAULT_RESERVE_GIB,
    Candidate,
    Choices,
    Cluster,
    flags,
    memory_gib,
    search,
    smallest_cluster,
)
from titanlite.plan.shape import layout_of, model_of, vocab_size_of
from titanlite.progress import Progress


def options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="plan", allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=8, help="GPUs in the cluster")
    p.add_argument("--gpus_per_node", type=int, default=8, help="GPUs per node (NVLink domain)")
    p.add_argument("--device", default="h100-sxm", help=f"one of {', '.join(DEVICES)}")
    for name in OVERRIDES:
        p.add_argument(f"--{name}", type=float, help=f"override the device's {name}")
    p.add_argument(
        "--reserve_gib",
        type=float,
        default=DEFAULT_RESERVE_GIB,
        help="memory per GPU left for the CUDA context and NCCL, outside the estimate",
    )
    p.add_argument("--global_batch_tokens", type=int, help="tokens per step (default: config's)")
    p.add_argument("--vocab_size", type=int, help="padded vocab (default: the tokenizer's)")
    p.add_argument("--top", type=int, default=10, help="rows shown")
    f8 = p.add_mutually_exclusive_group()
    f8.add_argument("--float8", action="store_true",
                    help="also plan float8 linears, a change of numerics (default: only if the "
                         "config converts its linears already)")  # fmt: skip
    f8.add_argument("--no_float8", action="store_true", help="plan without float8 linears")
    p.add_argument("--json", action="store_true", help="the rows as JSON")
    p.add_argument("--explain", type=int, metavar="N", help="the arithmetic behind row N")
    p.add_argument("--write", metavar="TOML", help="the best layout as a config train.py runs")
    p.add_argument("--check", type=int, default=1, metavar="K",
                   help="rebuild the best K layouts by the dry run (0: estimate only)")  # fmt: skip
    p.add_argument("--predict", action="store_true", help="the config's own layout's figures")
    p.add_argument("--calibrate", nargs="+", metavar="RUN_DIR",
                   help="fit the device's constants to these runs and save them")  # fmt: skip
    p.add_argument("--compare", nargs="+", metavar="RUN_DIR",
                   help="these runs' measured tokens/s beside the prediction (no fit)")  # fmt: skip
    p.add_argument("--calibration", help="constants file (default: the device's saved fit)")
    return p


def main(argv: list[str] | None = None) -> int:
    args, rest = options().parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args, rest)
    except ConfigError as e:
        print(f"plan: error: {e}", file=sys.stderr)
        return 2


def run(args, rest: list[str]) -> int:
    overrides = {k: getattr(args, k) for k in OVERRIDES}
    device = get_device(args.device, **overrides)
    if args.gpus < 1 or args.gpus_per_node < 1:
        raise ConfigError(f"--gpus and --gpus_per_node must be >= 1, got {args.gpus}, "
                          f"{args.gpus_per_node}")  # fmt: skip
    cluster = Cluster(args.gpus, min(args.gpus_per_node, args.gpus), device, args.reserve_gib)
    path = Path(args.calibration) if args.calibration else None
    if args.calibrate:
        return run_calibrate(args, device, path)
    constants = calibrate.load(args.device, path)
    if args.compare:
        print(f"constants: {constants}")
        print_runs(read_runs(args.compare, args), device, constants)
        return 0
    cfg = parse_args(rest)
    check_options(cfg)  # before the tokenizer is built, for the vocab
    vocab, missing = (args.vocab_size, "") if args.vocab_size else vocab_size_of(cfg)
    # The config as train.py resolves it on --gpus ranks: its checks, model and global batch.
    job = resolve_job(cfg, World(args.gpus), vocab)
    model = model_of(cfg, vocab)
    if args.predict:
        lo = layout_of(job)
        found = Candidate(lo, predict(model.shape, lo, device, cluster.gpus_per_node, constants),
                          memory_gib(model, lo))  # fmt: skip
        print(header(cfg, model, cluster, lo.global_batch, constants))
        print(table([found]) if not args.json else json.dumps([row_json(found)], indent=1))
        print(explain(found))
        return 0
    return run_plan(args, rest, job, model, cluster, constants, missing)


def run_plan(args, rest, job, model, cluster, constants, missing: str) -> int:
    """The search, the dry-run check of the best rows, the table, --explain and --write."""
    cfg, batch = job.config, global_batch(job, args)
    choices = Choices(float8=float8_choices(cfg, args), compile=cfg.compile.enable)
    plan = search(model, cluster, batch, constants, choices, progress=True)
    if not plan.fits:
        need = smallest_cluster(model, cluster, batch, constants, progress=True)
        gpus = f"{need} GPU" + ("s" if need > 1 else "")
        where = f"the smallest cluster where one does: {gpus}" if need else "none up to 16,384 GPUs"
        raise ConfigError(f"no layout of {cfg.model.flavor} with global batch {batch} fits "
                          f"{args.gpus} x {args.device} "
                          f"(rejected: {rejections(plan)}); {where}")  # fmt: skip
    if args.explain and not 1 <= args.explain <= min(len(plan.fits), args.top):
        raise ConfigError(f"--explain {args.explain}: rows are 1..{min(len(plan.fits), args.top)}")
    dropped, note = checked(plan, rest, 0 if missing else args.check)
    if args.json:
        print(json.dumps([row_json(c) for c in plan.fits[: args.top]], indent=1))
        return 0
    print(header(cfg, model, cluster, batch, constants))
    print(table(plan.fits[: args.top]))
    print(summary(plan))
    print(note or f"not checked by the dry run: {missing or '--check 0'}")
    for c, why in dropped:
        print(f"dropped {c.layout.describe()}: {why}")
    if args.explain:
        print(explain(plan.fits[args.explain - 1]))
    if args.write:
        best = parse_args([*rest, *flags(plan.fits[0].layout)])
        resolve_job(best, World(args.gpus), job.model_args.vocab_size)  # what train.py checks
        dump_toml(best, args.write)
        print(f"wrote {args.write}: train.py --job.config_file {args.write} on {args.gpus} GPUs")
    return 0


def float8_choices(cfg, args) -> tuple[bool, ...]:
    """float8 linears change the numerics: searched only when asked (--float8) or kept as the
    config has them, so that --write never switches them on unasked."""
    if args.float8:
        return (False, True)
    return (float8_enabled(cfg) and not args.no_float8,)


def checked(plan, config_argv: list[str], k: int) -> tuple[list, str]:
    """Dry-run the best layouts until `k` build (trying at most k + 2): drop those that do not,
    with their errors. Returns (dropped, what was checked)."""
    if k == 0:
        return [], ""
    dropped, passed = [], 0
    runs = Progress("plan: dry runs", k, unit="layouts", scale=1)
    for c in list(plan.fits[: k + 2]):
        why = dry_run(config_argv, c)
        runs.total += bool(why)  # a dropped layout: one more to check
        runs.add(1)
        if why:
            plan.fits.remove(c)
            dropped.append((c, why))
        elif (passed := passed + 1) == k:
            break
    runs.close()
    if not passed:
        raise ConfigError(f"the dry run failed on each of the {len(dropped)} best layouts (last: "
                          f"{dropped[-1][1]}); fix the config, or plan with --check 0")  # fmt: skip
    world = plan.fits[0].layout.world
    return dropped, f"checked by the dry run at world {world}: the best {passed}"


def global_batch(job, args) -> int:
    """Sequences per step: --global_batch_tokens, else what the job runs on --gpus ranks."""
    seq = job.config.training.seq_len
    if args.global_batch_tokens:
        if args.global_batch_tokens % seq:
            raise ConfigError(f"--global_batch_tokens {args.global_batch_tokens} is not a "
                              f"multiple of training.seq_len {seq}")  # fmt: skip
        return args.global_batch_tokens // seq
    return job.global_batch_size


def row_json(c: Candidate) -> dict:
    p = c.prediction
    mfu = None if c.layout.float8 else round(p.mfu, 4)  # as train.py: no bf16 MFU for float8
    return {"flags": flags(c.layout), "layout": c.layout.describe(),
            "tokens_per_s_per_gpu": round(p.tokens_per_s_per_gpu, 1), "mfu": mfu,
            "step_s": round(p.step_s, 4), "peak_memory_gib": round(c.memory_gib, 2),
            "split_s": {k: round(v, 4) for k, v in p.split.items()}}  # fmt: skip


def read_runs(folders: list[str], args) -> list:
    runs = [calibrate.read_run(d, args.vocab_size) for d in folders]
    return [replace(r, gpus_per_node=args.gpus_per_node) for r in runs]


def print_runs(runs: list, device, constants) -> None:
    """Each run's measured tokens/s, peak reserved and peak active memory beside the planner's
    figures (the active one beside the estimate less the allocator's cache: the live bytes)."""
    print(f"{'run':<40}{'tok/s':>10}{'predicted':>11}{'error':>8}{'GiB':>8}{'estimated':>11}"
          f"{'error':>8}{'active':>8}{'live est':>10}{'error':>8}")  # fmt: skip
    for r in runs:
        pred = calibrate.predicted_tps(r, device, constants)
        row = f"{r.folder:<40}{r.tokens_per_s:>10,.0f}{pred:>11,.0f}"
        row += f"{100 * (pred / r.tokens_per_s - 1):>7.1f}%"
        for measured, live, width in ((r.memory_gib, False, 11), (r.active_gib, True, 10)):
            est = memory_gib(r.model, r.layout, live=live)
            if measured:
                row += f"{measured:>8.1f}{est:>{width}.1f}{100 * (est / measured - 1):>7.1f}%"
            else:
                row += f"{'-':>8}{est:>{width}.1f}{'-':>8}"
        print(row)


def run_calibrate(args, device, path) -> int:
    runs = read_runs(args.calibrate, args)
    fitted = calibrate.fit(runs, device)
    saved = calibrate.save(fitted, args.device, runs, path)
    print_runs(runs, device, fitted)
    reader = f"--calibration {saved}" if path else f"--device {args.device}"
    print(f"constants: {fitted}\nsaved to {saved} (plans with {reader} read it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
