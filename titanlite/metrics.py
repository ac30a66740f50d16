"""FLOPs and MFU, device memory, and the per-step metrics sinks (console, TensorBoard, JSONL, W&B).

Units used throughout: `wps` is tokens per second per device, `tflops` is achieved TFLOP/s per
device, `mfu` is a percentage (0-100), memory is GiB (2**30 bytes).
"""

import logging
import math
import os
import re
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from titanlite.metrics_sinks import Sink, build_sinks
from titanlite.precision import has_fast_bf16

logger = logging.getLogger(__name__)

_GIB = 2**30

# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s per GPU. A row matches when every one of
# its words is a word of torch.cuda.get_device_name() (split on spaces and dashes), never a
# substring: "H200" must not match "GH200" nor "B200" match "GB200". First match wins, so a
# variant (NVL, PCIe) comes before its plain name, which is the SXM part.
# NVIDIA datasheets give the bf16 figure with 2:4 sparsity; the dense peak is half of it.
_PEAK_BF16_TFLOPS = (
    (("H100", "NVL"), 835.5),  # H100 datasheet: 1,671 with sparsity
    (("H100", "PCIE"), 756.5),  # H100 datasheet (2022 edition, PCIe): 1,513 with sparsity
    (("H100",), 989.5),  # H100 datasheet, SXM ("NVIDIA H100 80GB HBM3"): 1,979 with sparsity
    (("H200", "NVL"), 835.5),  # H200 datasheet, H200 NVL: 1,671 with sparsity
    (("H200",), 989.5),  # H200 datasheet, H200 SXM: 1,979 with sparsity
    (("GH200",), 989.5),  # GH200 Grace Hopper Superchip datasheet: 1,979 with sparsity
    (("GB200",), 2500.0),  # GB200 NVL72 datasheet, per Blackwell GPU: 5 PFLOPS with sparsity
    (("B200",), 2250.0),  # HGX B200 datasheet, per GPU: 4.5 PFLOPS with sparsity
    (("A100",), 312.0),  # A100 datasheet: 312 dense, 624 with sparsity
    (("L40S",), 362.0),  # L40S datasheet: 362.05 dense
    (("MI300X",), 1307.4),  # AMD Instinct MI300X datasheet: 1,307.4 dense
)

_warned_devices: set[str] = set()
_cpu_peak_cache: dict[tuple[torch.dtype, int], float] = {}


def num_flops_per_token(num_params: int, model_args, seq_len: int) -> int:
    """Training FLOPs per token: 6 * N + 12 * n_layers * n_heads * head_dim * seq_len.

    The PaLM (appendix B) / torchtitan convention: N counts every parameter except the token
    embedding (a lookup, no matmul) while the output projection counts; 6N is forward (2N) plus
    backward (4N); the second term is the attention scores and weighted sum (QK^T and PV), which
    have no parameters. The causal mask's saved half is not subtracted, as in both references.
    """
    head_dim = model_args.dim // model_args.n_heads
    return 6 * num_params + 12 * model_args.n_layers * model_args.n_heads * head_dim * seq_len


def get_peak_flops(
    device: torch.device, dtype: torch.dtype, override_tflops: float = 0.0, float8: bool = False
) -> float | None:
    """Peak FLOP/s of one device for MFU, or None when unknown (then no MFU is reported).

    override_tflops > 0 wins. With float8 linears there is no peak to report against (None, and
    the log says why), as torchtitan does. On GPU the table holds bf16 dense peaks; fp32 training
    is also measured against the bf16 peak (as torchtitan does), since bf16 is what the hardware
    is for.
    On CPU there is no datasheet number we can trust, so we calibrate (see _calibrate_cpu) in
    `dtype`, the dtype training computes in (resolve_param_dtype's result): a native-bf16 CPU's
    bf16 peak is several times its fp32 peak. Emulated bf16 (an AVX2 CPU) has no peak of its own:
    its speed varies ~2x with the matrix shape, so a calibration undershoots what the model
    reaches (MFU read 200% here); it is measured against the fp32 peak, the hardware's real one.
    """
    if override_tflops > 0:
        return override_tflops * 1e12
    if float8:
        logger.info(
            "MFU not reported: float8 linears run at up to twice the bf16 peak the device table "
            "holds, while attention and the unconverted linears do not, so no one peak fits; "
            "--metrics.peak_tflops sets the peak to measure against"
        )
        return None
    device = torch.device(device)
    if device.type == "cpu":
        if dtype == torch.bfloat16 and not has_fast_bf16(device):
            dtype = torch.float32
        return _calibrate_cpu(dtype)
    if device.type != "cuda" or not torch.cuda.is_available():
        return _warn_unknown(str(device))
    name = torch.cuda.get_device_name(device)
    words = set(re.split(r"[\s-]+", name.upper()))
    for keys, tflops in _PEAK_BF16_TFLOPS:
        if words.issuperset(keys):
            return tflops * 1e12
    return _warn_unknown(name)


def _warn_unknown(name: str) -> None:
    # Never guess a peak: a wrong MFU is worse than none. Warn once per device name.
    if name not in _warned_devices:
        _warned_devices.add(name)
        logger.warning(
            f"Peak FLOPs unknown for device '{name}': MFU will not be reported. "
            "Set --metrics.peak_tflops to the device's dense peak to enable it."
        )
    return None


def _calibrate_cpu(
    dtype: torch.dtype, target_s: float = 0.02, budget_s: float = 0.3, max_size: int = 2048
) -> float:
    """Best-of-3 FLOP/s of a square matmul in `dtype` (the compute dtype), once per process.

    The size is chosen by time, not fixed: a fixed 2048^3 took ~100 s where bf16 is emulated
    (~1 GFLOP/s on AVX2-only CPUs). It starts at 128 and doubles until the matmul is big enough
    to be compute-bound: one call takes `target_s` AND doubling the size (8x the work) at least
    quadrupled the time. Below that, per-call overhead (thread wake-up, worst on a busy CPU)
    would understate the peak and so inflate MFU; for the same reason the peak is the best rate
    of any size, so one stalled size cannot set it. No new size starts after `budget_s`, so it
    takes ~0.1-0.5 s, under 1 s on any CPU whose calls do not stall for tens of ms each.

    Per process means per rank: each rank measures with its own torch thread count, which is
    what its training matmuls get too (with several ranks on one machine each sees its share).
    Cached by (dtype, threads) so every later call is free.
    """
    key = (dtype, torch.get_num_threads())
    if key not in _cpu_peak_cache:
        size, prev, peak, start = 128, math.inf, 0.0, time.perf_counter()
        while True:
            a = torch.randn(size, size).to(dtype)
            b = torch.randn(size, size).to(dtype)
            a @ b  # warm-up: first call at a size pays for allocation and kernel selection
            best = min(_time_matmul(a, b) for _ in range(3))
            peak = max(peak, 2 * size**3 / best)
            compute_bound = best >= target_s and best >= 4 * prev
            if compute_bound or size >= max_size or time.perf_counter() - start > budget_s:
                break
            size, prev = 2 * size, best
        _cpu_peak_cache[key] = peak
        logger.info(
            f"CPU peak (matmul calibration, {dtype}, up to {size}^3, {key[1]} threads): "
            f"{_cpu_peak_cache[key] / 1e12:.3f} TFLOP/s"
        )
    return _cpu_peak_cache[key]


def _time_matmul(a: torch.Tensor, b: torch.Tensor) -> float:
    start = time.perf_counter()
    a @ b
    return time.perf_counter() - start


def compute_throughput(
    tokens: int, seconds: float, flops_per_token: float, peak_flops: float | None
) -> dict[str, float | None]:
    """wps, tflops and mfu (percent; None without a peak) for `tokens` processed by one device."""
    wps = tokens / seconds
    flops = wps * flops_per_token
    mfu = 100 * flops / peak_flops if peak_flops else None
    return {"wps": wps, "tflops": flops / 1e12, "mfu": mfu}


class LogWindow:
    """The steps since the last log line: their summed wall and data-loading time, and the
    last one's result (train.py's StepResult: loss and grad norm are logged for that step, not
    averaged)."""

    def __init__(self):
        self.steps, self.seconds, self.data_seconds, self.last = 0, 0.0, 0.0, None

    def add(self, out):
        self.steps += 1
        self.seconds += out.seconds
        self.data_seconds += out.data_seconds
        self.last = out


# Every name torch reads its allocator settings from.
ALLOC_CONF_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def default_expandable_segments(environ: dict, cuda: bool) -> None:
    """Expandable segments on CUDA unless the user set the allocator's settings under any name
    (the launch scripts do the same for their torchrun): a segment grows in place instead of new
    ones being reserved, so memory does not fragment into allocation retries and OOMs as tensor
    sizes vary. Called before CUDA initializes: the allocator reads its settings once, when it
    is created."""
    if cuda and not any(name in environ for name in ALLOC_CONF_NAMES):
        environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


@dataclass
class MemoryStats:
    """Peak memory since the last reset; allocator retries and OOMs since the process started.
    On CPU active == reserved == peak resident set size, and the counts are 0."""

    max_active_gib: float
    max_active_pct: float
    max_reserved_gib: float
    max_reserved_pct: float
    num_alloc_retries: int
    num_ooms: int


class DeviceMemoryMonitor:
    """Peak memory of this process's device: CUDA caching-allocator stats, or CPU peak RSS."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self.capacity = torch.cuda.get_device_properties(self.device).total_memory
        else:
            self.capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self._reported_retries = self._reported_ooms = 0
        self.reset_peak_stats()

    def log_values(self) -> dict[str, float]:
        """A log line's memory values: peak reserved GiB since the last reset_peak_stats (on CUDA
        also the peak active GiB: reserved minus active is what the allocator holds cached or
        fragmented), and the allocator's retry and OOM counts since the process started. Warns
        (on every rank: each has its own device) when a count grew since the previous call."""
        stats = self.get_peak_stats()
        new_retries = stats.num_alloc_retries - self._reported_retries
        new_ooms = stats.num_ooms - self._reported_ooms
        if new_retries > 0 or new_ooms > 0:
            # A retry means an allocation failed, so the allocator freed every cached block,
            # synchronized and tried again: the step stalls, and the next failure is an OOM.
            logger.warning(
                f"CUDA allocator near its limit since the last log line: {new_retries} more "
                f"allocation retries ({stats.num_alloc_retries} in all), {new_ooms} more "
                f"out-of-memory errors ({stats.num_ooms} in all); peak reserved "
                f"{stats.max_reserved_gib:.2f} GiB ({stats.max_reserved_pct:.0f}%). To fix: lower "
                "--training.local_batch_size (a set --training.global_batch_size is kept by "
                "accumulating microbatches), set "
                "--activation_checkpoint.mode selective or full, or use "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (train.py's default when the "
                "variable is unset)."
            )
        self._reported_retries, self._reported_ooms = stats.num_alloc_retries, stats.num_ooms
        values = {
            "memory_gib": stats.max_reserved_gib,
            "alloc_retries": stats.num_alloc_retries,
            "ooms": stats.num_ooms,
        }
        if self.device.type == "cuda":  # on CPU active is reserved: the peak RSS
            values["memory_active_gib"] = stats.max_active_gib
        return values

    def get_peak_stats(self) -> MemoryStats:
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            active = stats.get("active_bytes.all.peak", 0)
            reserved = stats.get("reserved_bytes.all.peak", 0)
            retries = stats.get("num_alloc_retries", 0)
            ooms = stats.get("num_ooms", 0)
        else:
            active = reserved = _peak_rss_bytes()
            retries = ooms = 0
        return MemoryStats(
            max_active_gib=active / _GIB,
            max_active_pct=100 * active / self.capacity,
            max_reserved_gib=reserved / _GIB,
            max_reserved_pct=100 * reserved / self.capacity,
            num_alloc_retries=retries,
            num_ooms=ooms,
        )

    def reset_peak_stats(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        # Linux resets VmHWM to the current RSS on "5" (since 4.0). Elsewhere, or when /proc is
        # read-only, the peak stays the process-lifetime peak, which is still a true upper bound.
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def init_logger(rank: int, log_rank: int | None = None, stream=None) -> None:
    """Root logging: the log rank (LOG_RANK env, default 0) at INFO, every other rank WARNING only.

    All output goes to stdout (or `stream`: a script whose stdout is its result logs to stderr)
    with the rank in each line so torchrun's interleaving stays readable.
    """
    if log_rank is None:
        log_rank = int(os.environ.get("LOG_RANK", "0"))
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(
        logging.Formatter(f"[r{rank}] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    )
    root.addHandler(handler)
    root.setLevel(logging.INFO if rank == log_rank else logging.WARNING)


# Console fields in order: (key, label, format).
_CONSOLE = (
    ("loss", "loss", "{:7.4f}"),
    ("grad_norm", "grad_norm", "{:5.3g}"),
    ("lr", "lr", "{:.1e}"),
    ("wps", "wps", "{:,.0f}"),
    ("tflops", "tflops", "{:.3g}"),
    ("mfu", "mfu", "{:.2f}%"),
    ("memory_gib", "mem", "{:.2f}GiB"),
    ("memory_active_gib", "active", "{:.2f}GiB"),
    ("data_time_pct", "data", "{:.1f}%"),
    ("data/skipped_rows", "skipped_rows", "{:,.0f}"),
    ("val_loss", "val_loss", "{:.4f}"),
    ("val_ppl", "val_ppl", "{:.2f}"),
)


def _largest_block(floats: dict) -> list[str]:
    """The console's stand-in for the per-block grad norms (grad_norm/<block> keys, written in
    full to TensorBoard and JSONL): the largest one, by name."""
    blocks = {k: v for k, v in floats.items() if k.startswith("grad_norm/") and v is not None}
    if not blocks:
        return []
    key = max(blocks, key=blocks.get)
    return [f"max_block {key.removeprefix('grad_norm/')} {blocks[key]:.3g}"]


def _slow_rank(floats: dict) -> list[str]:
    """'slow rank 3 +12.0% (data 10.5%)': the rank whose own work lags the median's most, by what
    share of a step, and how much of that is data loading (the rest is compute)."""
    if floats.get("slow_rank") is None:
        return []
    lag, data = floats["slow_rank_lag_pct"], floats["slow_rank_data_lag_pct"]
    return [f"slow rank {floats['slow_rank']:.0f} +{lag:.1f}% (data {data:.1f}%)"]


def _to_float(value) -> float | None:
    # Tensors and numpy scalars become Python floats so json.dumps writes them exactly.
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item()
    return float(value)


class MetricsLogger:
    """Writes one step's metrics to the console and the enabled sinks: TensorBoard,
    {dump_folder}/metrics.jsonl, Weights & Biases. Every sink gets the same values at the same
    steps (validation included: it is logged with its step's values).

    The log rank writes (the console of other ranks is muted by init_logger); with
    metrics.save_for_all_ranks every rank does, each under its own names (tb/rank_N,
    metrics_rank_N.jsonl, a W&B run per rank). On a rank that does not write every method is a
    no-op and no file is created. Values may be None or absent: they are left out of the console,
    TensorBoard and W&B and written as null in JSON. Keys beyond the standard ones (e.g.
    val_loss) are passed through. `run_config` (the JobConfig as a dict) is attached to the W&B
    run; `resuming` (the run resumes its own checkpoint) continues the folder's W&B run.
    """

    def __init__(self, metrics_cfg, dump_folder: str, rank: int = 0, log_rank: int = 0,
                 run_config: dict | None = None, resuming: bool = False):  # fmt: skip
        all_ranks = metrics_cfg.save_for_all_ranks
        self.enabled = all_ranks or rank == log_rank
        self.sinks: list[Sink] = []
        if self.enabled:
            sink_rank = rank if all_ranks else None
            self.sinks = build_sinks(
                metrics_cfg, Path(dump_folder), sink_rank, run_config, resuming
            )

    def log(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        floats = {k: _to_float(v) for k, v in values.items()}
        parts = [f"step {step:>5}"]
        for key, label, fmt in _CONSOLE:
            if floats.get(key) is not None:
                parts.append(f"{label} {fmt.format(floats[key])}")
        parts += _largest_block(floats) + _slow_rank(floats)
        logger.info("  ".join(parts))
        for sink in self.sinks:
            sink.write(step, floats)

    def close(self, exit_code: int = 0) -> None:
        """Flush and close every sink; a nonzero `exit_code` marks the W&B run failed."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close(exit_code)
