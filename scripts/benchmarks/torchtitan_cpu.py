"""Run torchtitan's trainer on a CPU (gloo), for bench_torchtitan.py's side-by-side runs.

torchtitan's files are not changed. This runs in torchtitan's venv (its package on PYTHONPATH),
imports torchtitan, replaces at run time the few functions that fail on a CPU-only torch, then
calls torchtitan's own entry point (torchtitan.train.main) with the remaining arguments:

    cd TORCHTITAN && PYTHONPATH=TORCHTITAN OMP_NUM_THREADS=1 \\
        torchrun --standalone --nproc_per_node 2 /path/to/scripts/benchmarks/torchtitan_cpu.py \\
        --data-file corpus.jsonl -- --module llama3 --config llama3_debugmodel ...
    # apply the replacements, print the commit, exit:
    python scripts/benchmarks/torchtitan_cpu.py --check

Written against torchtitan b5bcd76c66d0acb1a08b176d9639425bc55e0b2a (2026-08-21, "Introduce a
storage seam in BaseCheckpointManager (#4186)") and torch 2.13.0+cpu. Another commit gets a
warning; a replaced function or class that is missing (or changed its arguments) stops the run
with one line naming it. The replacements:

1. device type: with no accelerator torchtitan falls back to "cuda" (torch.cuda.set_device then
   fails on a CPU wheel); here it is "cpu", so the process group resolves to gloo.
2. memory monitor: torch.cpu has no device name, properties, memory stats or peak reset; on CPU
   the monitor reports the process' peak resident set (getrusage) against physical RAM.
3. process-group timeouts: the barrier passes device_ids=[current_device()] (the string "cpu"
   on CPU), and torch.distributed.set_timeout is not in torch 2.13 (torchtitan tracks nightlies);
   the barrier runs without device ids and the timeout goes through torch's _set_pg_timeout.
4. FSDP gradient reduction: torchtitan sets the gradient divide factor to 1.0, which makes FSDP
   reduce-scatter with ReduceOp.PREMUL_SUM(1.0), which gloo rejects; a plain SUM is the same
   for a factor of 1, so the FSDP modules are told to force SUM reductions.
5. attention: FlexAttention has no CPU backward (torch 2.13) and varlen attention no CPU kernel.
   On CPU the FlexAttention module evaluates its BlockMask's mask_mod densely once per mask
   (shared by the layers), and when that is causal attention within consecutive spans (the
   packed documents of the LM data) runs one causal scaled_dot_product_attention per span;
   any other mask runs as SDPA with the dense boolean mask.
6. data: the c4_test dataset entry is pointed at --data-file (a local JSON-lines file in C4's
   schema), so no download is needed and both frameworks read the same documents.
7. logging: ranks other than 0 log warnings only (as titanlite's do), so the console holds one
   step line per step and its arrival time can be read by the bench.
"""

import argparse
import inspect
import os
import subprocess
import sys
from pathlib import Path

PINNED_COMMIT = "b5bcd76c66d0acb1a08b176d9639425bc55e0b2a"


class ShimError(RuntimeError):
    """torchtitan is not what the replacements were written for."""


def need(obj, name: str, params: tuple[str, ...] = ()):
    """obj.name, checked to exist (and, for a callable, to take `params`)."""
    where = getattr(obj, "__name__", type(obj).__name__)
    if not hasattr(obj, name):
        raise ShimError(f"torchtitan has no {where}.{name}; shim written against {PINNED_COMMIT}")
    value = getattr(obj, name)
    if params:
        have = set(inspect.signature(value).parameters)
        if missing := [p for p in params if p not in have]:
            raise ShimError(
                f"torchtitan's {where}.{name} no longer takes {missing}; shim written against "
                f"{PINNED_COMMIT}"
            )
    return value


def checkout_commit(package_dir: Path) -> str:
    """The git commit of the checkout holding the torchtitan package ('unknown' outside git)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(package_dir.parent), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


# ------------------------------------------------------------------ 5. attention on CPU
def document_spans(mask) -> list[tuple[int, int]] | None:
    """[(start, end), ...] when the [T, T] boolean mask is exactly causal attention within
    consecutive spans covering 0..T, else None."""
    import torch

    t = mask.shape[0]
    idx = torch.arange(t, device=mask.device)
    first = mask.to(torch.int8).argmax(dim=1)  # each query's first allowed key (0 if none)
    starts = first == idx  # a span starts where a query's first key is itself
    if t == 0 or not bool(starts[0]):
        return None
    span = starts.cumsum(0)
    expected = (span[:, None] == span[None, :]) & (idx[:, None] >= idx[None, :])
    if not torch.equal(mask, expected):
        return None
    bounds = starts.nonzero().flatten().tolist() + [t]
    return list(zip(bounds[:-1], bounds[1:]))


def spans_attention(q, k, v, plan, scale=None, enable_gqa=False):
    """Attention of [N, T, H] q, k, v under `plan`: a list of spans (causal SDPA per span,
    concatenated along T) or a dense [T, T] boolean mask (True = attend)."""
    import torch
    import torch.nn.functional as F

    if isinstance(plan, list):
        outs = [
            F.scaled_dot_product_attention(
                q[:, s:e], k[:, s:e], v[:, s:e], is_causal=True, scale=scale,
                enable_gqa=enable_gqa,
            )
            for s, e in plan
        ]  # fmt: skip
        return torch.cat(outs, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=plan, scale=scale, enable_gqa=enable_gqa
    )


class _MaskPlans:
    """The plan of the last BlockMask seen: one mask serves every layer of a step."""

    def __init__(self):
        self.mask, self.plan = None, None

    def get(self, block_mask, seq_len: int, device):
        import torch

        if block_mask is not self.mask:
            idx = torch.arange(seq_len, device=device)
            zero = torch.zeros((), dtype=torch.int32, device=device)  # batch and head index
            dense = block_mask.mask_mod(zero, zero, idx[:, None], idx[None, :])
            dense = dense.expand(seq_len, seq_len).to(torch.bool)
            spans = document_spans(dense)
            self.mask, self.plan = block_mask, spans if spans is not None else dense
        return self.plan


def patch_flex_attention(attention_module) -> None:
    flex = need(attention_module, "FlexAttention")
    original = need(flex, "forward", ("q_TNH", "k_TNH", "v_TNH", "attention_masks"))
    plans = _MaskPlans()

    def forward(self, q_TNH, k_TNH, v_TNH, *, attention_masks, score_mod=None, scale=None,
                enable_gqa=False, out_transform=None, **kwargs):  # fmt: skip
        if q_TNH.device.type != "cpu":
            return original(
                self, q_TNH, k_TNH, v_TNH, attention_masks=attention_masks, score_mod=score_mod,
                scale=scale, enable_gqa=enable_gqa, out_transform=out_transform, **kwargs,
            )  # fmt: skip
        if score_mod is not None or out_transform is not None:
            raise NotImplementedError(
                "torchtitan_cpu's CPU attention runs masks only (no score_mod, no LSE output)"
            )
        q, k, v = (x.transpose(0, 1) for x in (q_TNH, k_TNH, v_TNH))  # [T, N, H] -> [N, T, H]
        plan = plans.get(attention_masks, q.shape[1], q.device)
        out = spans_attention(q, k, v, plan, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(0, 1)  # [N, T, H] -> [T, N, H]

    flex.forward = forward


# ------------------------------------------------------------------ 1. device type
def patch_device_type():
    """Before any other torchtitan module is imported: they bind device_type/device_module from
    torchtitan.tools.utils at import time."""
    import torch

    if torch.cuda.is_available():
        return None
    import torchtitan.tools.utils as utils

    need(utils, "get_device_info")
    need(utils, "device_type")
    need(utils, "device_module")
    utils.device_type, utils.device_module = "cpu", torch.cpu
    utils.get_device_info = lambda: ("cpu", torch.cpu)
    return utils


# ------------------------------------------------------------------ 2. memory monitor
def patch_memory_monitor(metrics_module) -> None:
    import resource

    need(metrics_module, "DeviceMemoryMonitor")
    stats = need(metrics_module, "DeviceMemStats")
    need(metrics_module, "build_device_memory_monitor")

    class CPUMemoryMonitor:
        """Peak resident set of this process (never reset: getrusage keeps the lifetime peak)."""

        def __init__(self, device: str = "cpu"):
            self.device_name = "cpu"
            self.device_capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            self.device_capacity_gib = self.device_capacity / 2**30

        def get_peak_stats(self):
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
            gib, pct = peak / 2**30, 100 * peak / self.device_capacity
            return stats(gib, pct, gib, pct, 0, 0)

        def reset_peak_stats(self):
            pass

    metrics_module.DeviceMemoryMonitor = CPUMemoryMonitor


# ------------------------------------------------------------------ 3. process-group timeouts
def patch_pg_timeouts(dist_utils) -> None:
    import torch
    import torch.distributed as dist

    need(dist_utils, "set_pg_timeouts", ("timeout", "parallel_dims"))

    def set_pg_timeouts(timeout, parallel_dims):
        dist.barrier()  # every rank arrives before any shortens its timeout (no device ids)
        torch.cpu.synchronize()
        meshes = parallel_dims.get_all_one_dimensional_meshes().values()
        set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
        for group in [mesh.get_group() for mesh in meshes] + [None]:  # None: the world group
            set_timeout(timeout, group)

    dist_utils.set_pg_timeouts = set_pg_timeouts


# ------------------------------------------------------------------ 4. FSDP reductions on gloo
def patch_fsdp_sum_reduction(fsdp_module) -> None:
    from torch.distributed.fsdp import FSDPModule

    original = need(fsdp_module, "disable_fsdp_gradient_division", ("model",))
    need(FSDPModule, "set_force_sum_reduction_for_comms")

    def disable_fsdp_gradient_division(model):
        original(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    fsdp_module.disable_fsdp_gradient_division = disable_fsdp_gradient_division


# ------------------------------------------------------------------ 6. data, 7. logging
def patch_dataset(text_datasets, data_file: str) -> None:
    datasets = need(text_datasets, "DATASETS")
    if "c4_test" not in datasets:
        raise ShimError(
            f"torchtitan's DATASETS has no c4_test; shim written against {PINNED_COMMIT}"
        )
    kwargs = need(datasets["c4_test"].source, "load_dataset_kwargs")
    kwargs["data_files"] = str(Path(data_file).resolve())


def patch_logging(train_module) -> None:
    import logging

    init_logger = need(train_module, "init_logger")

    def init_logger_rank0():
        init_logger()
        if int(os.environ.get("RANK", "0")) != 0:
            logging.getLogger().setLevel(logging.WARNING)
            need(sys.modules["torchtitan.tools.logging"], "logger").setLevel(logging.WARNING)

    train_module.init_logger = init_logger_rank0


def apply(data_file: str = "") -> str:
    """Every replacement, in import order; returns the checkout's commit."""
    import importlib

    utils = patch_device_type()
    train = importlib.import_module("torchtitan.train")
    commit = checkout_commit(Path(train.__file__).resolve().parent)
    if commit != PINNED_COMMIT and int(os.environ.get("RANK", "0")) == 0:
        print(f"torchtitan_cpu: warning: torchtitan checkout at {commit}, these replacements "
              f"were written against {PINNED_COMMIT}", file=sys.stderr, flush=True)  # fmt: skip
    if utils is not None:  # CPU only
        for name in ("torchtitan.distributed.utils", "torchtitan.components.metrics",
                     "torchtitan.distributed.parallel_dims"):  # fmt: skip
            if getattr(sys.modules[name], "device_type", "cpu") != "cpu":
                raise ShimError(f"{name} bound device_type before the CPU fallback was set")
        patch_memory_monitor(sys.modules["torchtitan.components.metrics"])
        patch_pg_timeouts(sys.modules["torchtitan.distributed.utils"])
        patch_fsdp_sum_reduction(importlib.import_module("torchtitan.distributed.fsdp"))
        patch_flex_attention(importlib.import_module("torchtitan.models.common.attention"))
    if data_file:
        patch_dataset(importlib.import_module("torchtitan.hf_datasets.text_datasets"), data_file)
    patch_logging(train)
    return commit


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-file", default="", help="local JSON-lines file for c4_test")
    ap.add_argument("--check", action="store_true", help="apply the replacements, print, exit")
    args = ap.parse_args(own)
    if args.data_file and not Path(args.data_file).is_file():
        ap.error(f"--data-file {args.data_file!r} is not a file")
    try:
        commit = apply(args.data_file)
    except ImportError as e:
        print(f"torchtitan_cpu: cannot import torchtitan or its dependencies: {e}", file=sys.stderr)
        return 2
    except ShimError as e:
        print(f"torchtitan_cpu: {e}", file=sys.stderr)
        return 2
    if args.check:
        print(f"torchtitan_cpu: ok, torchtitan {commit}")
        return 0
    sys.argv = [sys.argv[0], *rest]
    sys.modules["torchtitan.train"].main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
