"""titanlite's training step vs a bare PyTorch loop on the same model, data and optimizer.

    python scripts/benchmarks/bench_overhead.py                   # debug model, fp32, batch 8 x 256
    python scripts/benchmarks/bench_overhead.py --dtype bfloat16 --rounds 5
    python scripts/benchmarks/bench_overhead.py --custom_model 768,12,12 --batch 1   # ~100M params

One process, in-process: train.py's Trainer is built from the same JobConfig train.py would
parse, and a bare loop (model(tokens) -> logits -> F.cross_entropy -> backward -> AdamW step ->
zero_grad, nothing else) runs a second Transformer of the same shape with the same optimizer
settings on the same microbatches. The two alternate in blocks of --steps steps for --rounds
rounds after --warmup steps each, so machine load hits both alike; the result is the ratio of
median step times (trainer / bare; target <= 1.05) and tokens/s of each.

Then the kernel floor (scripts/benchmarks/kernel_floor.py): one more titanlite step records its
matmul and attention calls, each is replayed alone on random tensors of the same layout, and their
sum is the fastest any step could be with these kernels. The last line, `step/floor X.XX`, is the
titanlite median step over that floor (--no-floor skips it).

The trainer's step is `loader.next_step()` + `Trainer.train_step` (token count, forward with the
loss inside the model, backward, global-norm clip, finite check, optimizer and LR schedule step,
zero_grad): everything train.py's loop does per step except logging every log_freq steps.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from kernel_floor import record_kernels, sync, time_kernels  # noqa: E402  (this folder)

from titanlite.config_parse import parse_args  # noqa: E402
from titanlite.distributed import destroy  # noqa: E402
from titanlite.models.decoder.model import Transformer  # noqa: E402
from titanlite.models.llama.args import LLAMA3_FLAVORS, ModelArgs  # noqa: E402


def register_custom_flavor(spec: str) -> str:
    """'dim,n_layers,n_heads' -> a flavor name in the (in-process) flavor table."""
    try:
        dim, layers, heads = (int(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"--custom_model wants dim,n_layers,n_heads, got {spec!r}") from None
    name = f"custom_{dim}x{layers}x{heads}"
    LLAMA3_FLAVORS[name] = ModelArgs(dim=dim, n_layers=layers, n_heads=heads)
    return name


def build_trainer(opts):
    import train  # the repo root is on sys.path: the real Trainer, not a copy

    flavor = register_custom_flavor(opts.custom_model) if opts.custom_model else opts.flavor
    cfg = parse_args(
        [
            "--job.config_file", "debug_model.toml",
            "--job.dump_folder", opts.dump_folder,
            "--model.flavor", flavor,
            "--training.local_batch_size", str(opts.batch),
            "--training.seq_len", str(opts.seq_len),
            "--training.mixed_precision_param", opts.dtype,
            "--training.steps", "1000000",
            "--metrics.peak_tflops", "1",  # skip the CPU calibration: no MFU here
            "--no-metrics.enable_tensorboard", "--no-metrics.enable_jsonl",
            *opts.overrides,
        ]
    )  # fmt: skip
    return train.Trainer(cfg, train.init_distributed())


def build_bare(trainer, opts):
    """Same shape, same init scheme, same AdamW (build_optimizer: implementation, two groups)."""
    from titanlite.optim import build_optimizer

    torch.manual_seed(0)
    device = trainer.device
    with torch.device(device):
        model = Transformer(trainer.model_args)
    model.init_weights()
    optimizer = build_optimizer(model, trainer.cfg.optimizer)
    dtype = {"float32": None, "bfloat16": torch.bfloat16}[opts.dtype]

    def step(microbatches):
        for tokens, labels in microbatches:
            tokens, labels = tokens.to(device), labels.to(device)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                logits = model(tokens)  # [b, s, vocab]
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def time_steps(fn, n: int, device: torch.device) -> list[float]:
    times = []
    for _ in range(n):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def report_floor(trainer, step_seconds: float) -> None:
    floor, rows = time_kernels(record_kernels(trainer.train_step), trainer.device)
    print("kernel floor (each call alone, median of 5, summed over one step):")
    for name, calls, secs, rate in rows:
        gflops = f" ({rate / 1e9:.0f} GFLOP/s)" if rate else ""
        print(f"  {name:<52} {calls:4d} calls {secs * 1e3:9.2f} ms{gflops}")
    print(f"floor {floor * 1e3:.1f} ms, titanlite step {step_seconds * 1e3:.1f} ms")
    print(f"step/floor {step_seconds / floor:.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--custom_model", default="", help="dim,n_layers,n_heads (overrides flavor)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = cores // processes)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="steps per block")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (>= 3)")
    p.add_argument("--floor", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the step's kernels alone (step/floor)")  # fmt: skip
    p.add_argument("--dump_folder", default="./outputs/bench_overhead")
    p.add_argument("overrides", nargs="*", help="extra train.py options (after --)")
    opts = p.parse_args(argv)
    if opts.rounds < 3:
        raise SystemExit("--rounds must be >= 3 (medians of fewer mean little)")
    if opts.threads < 0:
        raise SystemExit(f"--threads must be >= 0 (0 = the trainer's default), got {opts.threads}")
    if opts.threads:
        # The trainer's start sets cores // local processes threads unless OMP_NUM_THREADS is set.
        os.environ["OMP_NUM_THREADS"] = str(opts.threads)
        torch.set_num_threads(opts.threads)
    trainer = build_trainer(opts)
    bare_step = build_bare(trainer, opts)
    batch = trainer.loader.next_step()
    tokens = opts.batch * opts.seq_len
    runners = {
        "bare": lambda: bare_step(batch),
        "titanlite": trainer.train_step,  # fetches its own (prefetched) step
    }
    print(f"model {trainer.model_args}\n{tokens} tokens/step, {opts.dtype}, threads "
          f"{torch.get_num_threads()}")  # fmt: skip
    for fn in runners.values():
        time_steps(fn, opts.warmup, trainer.device)
    medians = {name: [] for name in runners}
    for r in range(opts.rounds):
        for name, fn in runners.items():
            times = time_steps(fn, opts.steps, trainer.device)
            medians[name].append(statistics.median(times))
            print(f"round {r + 1} {name:>9}: median step {medians[name][-1] * 1e3:8.1f} ms "
                  f"({tokens / medians[name][-1]:,.0f} tokens/s)", flush=True)  # fmt: skip
    bare, ours = (statistics.median(medians[k]) for k in ("bare", "titanlite"))
    # Paired per round (adjacent blocks share the machine's load at that moment): the median of
    # these ratios is the headline; the ratio of overall medians is printed next to it.
    ratios = [o / b for o, b in zip(medians["titanlite"], medians["bare"])]
    print(
        f"bare {tokens / bare:,.0f} tokens/s, titanlite {tokens / ours:,.0f} tokens/s (medians)"
        f"\nstep time ratio titanlite/bare: median of per-round ratios "
        f"{statistics.median(ratios):.3f} (rounds: "
        + ", ".join(f"{x:.3f}" for x in ratios)
        + f"); ratio of medians {ours / bare:.3f}"
    )
    if opts.floor:
        report_floor(trainer, ours)
    trainer.close()
    destroy()  # the one-rank process group: left to interpreter exit it can abort
    return 0


if __name__ == "__main__":
    sys.exit(main())
