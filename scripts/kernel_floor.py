"""The kernel floor of a training step: its matmuls and attention calls alone, timed.

    from kernel_floor import record_kernels, time_kernels
    calls = record_kernels(lambda: trainer.train_step())     # one eager step, calls recorded
    floor = time_kernels(calls, device)                       # seconds, and a table per op

A step can be no faster than the compute kernels it launches; everything else (norms, RoPE,
activations, casts, the optimizer, Python) is what a framework adds or could fuse away. The
recorder sees each aten matmul and attention call (forward and backward) with its shapes,
strides and dtypes; the replay runs each distinct call on fresh random tensors of the same
layout, in a loop, with nothing else around it, so the floor is what those kernels cost on this
machine with warm caches. step / floor is then the headroom a step has left.
"""

import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


def time_kernels(calls: Counter, device: torch.device, iters: int = 5):
    """(floor seconds, rows): rows are (op, calls per step, seconds per step), slowest first."""
    per_op = Counter()
    n_calls = Counter()
    for (func, args, kwargs), count in calls.items():
        name = func.overloadpacket.__name__
        per_op[name] += count * time_call(func, args, kwargs, device, iters)
        n_calls[name] += count
    rows = [(name, n_calls[name], secs) for name, secs in per_op.most_common()]
    return sum(per_op.values()), rows
