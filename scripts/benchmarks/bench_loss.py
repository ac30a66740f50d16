"""Peak memory and time of the loss alone (forward + backward): plain vs chunked linear CE.

    python scripts/benchmarks/bench_loss.py --dim 4096 --vocab 128256 --tokens 8192 --dtype bfloat16

Each run is a fresh subprocess so that one variant's peak cannot hide another's, and variants are
interleaved over rounds so that a load change on a shared machine hits them alike. Memory is
the peak increase over the moment the inputs (h, weight, labels) exist: on CUDA from the caching
allocator's peak counter, on CPU from the kernel's peak RSS (VmHWM), reset via /proc/self/clear_refs
after the inputs are built. Both paths keep h.grad and weight.grad at the end, so both peaks include
them. CPU timings are noisy when other processes share the cores.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from titanlite.loss import cross_entropy_sum, linear_cross_entropy_sum  # noqa: E402

GIB = 1024**3


def _cpu_status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # the kernel reports kB
    raise RuntimeError(f"{key} not in /proc/self/status")


def _reset_peak(device: torch.device) -> int:
    """Start a fresh peak counter; returns the current usage as the baseline."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    Path("/proc/self/clear_refs").write_text("5")  # Linux: reset VmHWM to the current RSS
    return _cpu_status_bytes("VmRSS")


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _cpu_status_bytes("VmHWM")


def run_variant(args, chunk: int) -> dict:
    """One variant in this process: chunk 0 = plain logits + cross_entropy_sum."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    # Built directly in the target dtype: no fp32 staging copy inflates the baseline.
    h = torch.randn(args.tokens, args.dim, generator=gen, device=device, dtype=dtype)
    weight = torch.randn(args.vocab, args.dim, generator=gen, device=device, dtype=dtype)
    weight.mul_(args.dim**-0.5)  # output-layer init scale: logits of order 1
    h.requires_grad_()
    weight.requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen, device=device)
    labels[::10] = -100  # some ignored tokens, as packing/masking produces

    def step() -> float:
        h.grad = weight.grad = None
        if chunk:
            loss = linear_cross_entropy_sum(h, weight, labels, chunk)
        else:
            loss = cross_entropy_sum(h @ weight.T, labels)
        loss.backward()
        return loss.item()  # .item() also waits for the device

    base = _reset_peak(device)
    times = []
    for i in range(args.warmup + args.iters):
        t0 = time.perf_counter()
        loss = step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return {"peak": _peak(device) - base, "times": times, "loss": loss}


def run_in_subprocess(chunk: int) -> dict:
    # A fresh process per run: peak counters and allocator caches start clean.
    cmd = [sys.executable, __file__, *sys.argv[1:], "--variant", str(chunk)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"variant {chunk} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--chunks", default="512,1024,2048", help="chunk_tokens values, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="runs of every variant, interleaved")
    p.add_argument("--iters", type=int, default=1, help="timed iterations per run")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations per run")
    p.add_argument("--variant", type=int, default=None, help=argparse.SUPPRESS)  # child mode
    args = p.parse_args()
    if args.variant is not None:
        print(json.dumps(run_variant(args, args.variant)))
        return

    device = "cuda" if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    print(f"dim {args.dim}, vocab {args.vocab}, tokens {args.tokens}, {args.dtype}; {device}, "
          f"torch {torch.__version__}.")  # fmt: skip
    print(f"{args.rounds} interleaved rounds; each runs every variant in a fresh process "
          f"({args.warmup} warmup + {args.iters} timed iterations).")  # fmt: skip
    print("Time: median over all timed iterations. Peak: max over runs, over the inputs,"
          " including the grads.\n")  # fmt: skip
    variants = [0] + [int(c) for c in args.chunks.split(",")]
    runs = {v: [] for v in variants}
    # Interleaved rounds: a load change on a shared machine hits every variant alike.
    for _ in range(args.rounds):
        for v in variants:
            runs[v].append(run_in_subprocess(v))
    head = ["loss", "peak memory over inputs (GiB)", "vs plain", "median fwd+bwd (ms)", "vs plain"]
    print("| " + " | ".join([*head, "loss value"]) + " |")
    print("|---|" + "---:|" * 5)
    ref_peak = ref_time = None
    for v in variants:
        peak = max(r["peak"] for r in runs[v])
        t = statistics.median(x for r in runs[v] for x in r["times"])
        ref_peak, ref_time = ref_peak or peak, ref_time or t
        cells = [
            f"chunked {v}" if v else "plain",
            f"{peak / GIB:.2f}",
            f"{peak / ref_peak:.2f}",
            f"{t * 1e3:.1f}",
            f"{t / ref_time:.2f}",
            f"{runs[v][-1]['loss']:.2f}",
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
