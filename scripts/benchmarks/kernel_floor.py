"""The kernel floor of a training step: its matmuls and attention calls alone, timed.

    from kernel_floor import record_kernels, time_kernels
    calls = record_kernels(lambda: trainer.train_step())     # one eager step, calls recorded
    floor = time_kernels(calls, device)                       # seconds, and a table per op

    # this machine's own matmul rate, for comparison:
    python scripts/benchmarks/kernel_floor.py [--procs 2]

A step can be no faster than the compute kernels it launches; everything else (norms, RoPE,
activations, casts, the optimizer, Python) is what a framework adds or could fuse away. The
recorder sees each aten matmul and attention call (forward and backward) with its shapes,
strides and dtypes; the replay runs each distinct call on fresh random tensors of the same
layout, in a loop, with nothing else around it, so the floor is what those kernels cost on this
machine with warm caches. step / floor is then the headroom a step has left.

Run as a script it measures how fast this machine multiplies at best: a 2048 x 2048 x 2048
matmul in fp32 and bf16, on 1 thread, on all threads, and in --procs one-thread processes at once
(the figure a data-parallel run of that many processes can reach). A floor whose GEMMs run at
that rate cannot be lowered by any framework: only by fewer FLOPs.
"""

import argparse
import multiprocessing
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from titanlite.precision import has_fast_bf16  # noqa: E402

aten = torch.ops.aten
# The ops whose time is the step's irreducible compute: GEMMs and attention, forward and backward
# (each backend's own op, since SDPA dispatches to one of them per device and dtype).
KERNEL_OPS = {
    aten.mm, aten.addmm, aten.bmm, aten.baddbmm,
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
    aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_cudnn_attention_backward,
}  # fmt: skip


class TensorSpec(tuple):
    """(shape, stride, dtype, device) of a tensor argument: enough to make an equal-layout one."""

    def make(self) -> torch.Tensor:
        shape, stride, dtype, device = self
        # Filled as flat storage: a layout can repeat elements (stride 0: an expanded grad).
        extent = 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0
        flat = torch.empty(extent, dtype=dtype, device=device)
        # Integer inputs are RNG seeds and offsets: any value times the same.
        flat.normal_() if dtype.is_floating_point else flat.zero_()
        return flat.as_strided(shape, stride)


def _spec(x):
    if isinstance(x, torch.Tensor):
        return TensorSpec((tuple(x.shape), tuple(x.stride()), x.dtype, x.device))
    if isinstance(x, (list, tuple)):
        return type(x)(_spec(v) for v in x)
    return x


def _make(x):
    if isinstance(x, TensorSpec):
        return x.make()
    if isinstance(x, (list, tuple)):
        return type(x)(_make(v) for v in x)
    return x


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in KERNEL_OPS:
            spec = (func, _spec(args), tuple(sorted((k, _spec(v)) for k, v in kwargs.items())))
            self.calls[spec] += 1
        return func(*args, **kwargs)


def record_kernels(step) -> Counter:
    """Run `step()` once and count its kernel calls by (op, argument layout). Compiled code runs
    eagerly here (a dispatch mode cannot see into it): its GEMMs and attention are the same."""
    with torch.compiler.set_stance("force_eager"), _Recorder() as rec:
        step()
    return rec.calls


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(func, args, kwargs, device, iters: int) -> float:
    """Median seconds of one call on fresh random inputs of the recorded layout."""
    args, kwargs = _make(args), {k: _make(v) for k, v in kwargs}
    func(*args, **kwargs)  # warm-up: kernel selection, caches
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        func(*args, **kwargs)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_flops(func, args) -> int:
    """FLOPs of one recorded GEMM call (0 for attention): 2 m n k per product."""
    packet = func.overloadpacket
    if packet in (aten.addmm, aten.baddbmm):
        args = args[1:]  # (bias, a, b)
    if packet not in (aten.mm, aten.addmm, aten.bmm, aten.baddbmm):
        return 0
    (a_shape, *_), (b_shape, *_) = args[0], args[1]
    batch = a_shape[0] if len(a_shape) == 3 else 1
    return 2 * batch * a_shape[-2] * a_shape[-1] * b_shape[-1]


def time_kernels(calls: Counter, device: torch.device, iters: int = 5):
    """(floor seconds, rows): rows are (op, calls per step, seconds per step, FLOP/s or 0),
    slowest first."""
    per_op, n_calls, flops = Counter(), Counter(), Counter()
    for (func, args, kwargs), count in calls.items():
        name = func.overloadpacket.__name__
        per_op[name] += count * time_call(func, args, kwargs, device, iters)
        n_calls[name] += count
        flops[name] += count * gemm_flops(func, args)
    rows = [(name, n_calls[name], secs, flops[name] / secs) for name, secs in per_op.most_common()]
    return sum(per_op.values()), rows


def matmul_rate(dtype: torch.dtype, threads: int, n: int = 2048, calls: int = 5) -> float:
    """FLOP/s of an n x n x n matmul on `threads` CPU threads, median of `calls`."""
    torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    square = TensorSpec(((n, n), (n, 1), dtype, cpu))  # time_call makes random ones of it
    return 2 * n**3 / time_call(aten.mm.default, (square, square), (), cpu, calls)


def _rate_in_process(dtype: torch.dtype, start, results) -> None:
    start.wait()  # all processes multiply at the same time
    results.put(matmul_rate(dtype, threads=1))


def concurrent_rate(dtype: torch.dtype, procs: int) -> float:
    """Summed FLOP/s of `procs` one-thread processes multiplying at once."""
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(procs), ctx.Queue()
    workers = [
        ctx.Process(target=_rate_in_process, args=(dtype, start, results)) for _ in range(procs)
    ]
    for w in workers:
        w.start()
    total = sum(results.get() for _ in workers)
    for w in workers:
        w.join()
    return total


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description="This machine's matmul rate (see the module docstring)."
    )
    p.add_argument("--procs", type=int, default=2, help="one-thread processes multiplying at once")
    opts = p.parse_args(argv)
    if opts.procs < 1:
        p.error(f"--procs must be at least 1, got {opts.procs}")
    cores = torch.get_num_threads()
    for dtype in (torch.float32, torch.bfloat16):
        if dtype == torch.bfloat16 and not has_fast_bf16(torch.device("cpu")):
            # Emulated bf16 multiplies at ~1 GFLOP/s: each timed call would take ~17 s, the
            # whole row minutes, for a rate no run uses (auto precision computes in fp32 here).
            print(f"{str(dtype):<15} not timed: emulated on this CPU (no AVX512-BF16 or AMX)")
            continue
        one, all_threads = matmul_rate(dtype, 1), matmul_rate(dtype, cores)
        together = concurrent_rate(dtype, opts.procs)
        print(f"{str(dtype):<15} 1 thread {one / 1e9:7.1f} GFLOP/s | {cores} threads "
              f"{all_threads / 1e9:7.1f} | {opts.procs} processes x 1 thread, summed "
              f"{together / 1e9:7.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
