"""Achieved bf16 throughput of the kernels a training step is made of, alone, on this GPU: the
ceilings against which the planner's fitted efficiencies (titanlite/plan/perf.py) can be read.

    python scripts/benchmarks/gpu_peaks.py   # JSON: TFLOP/s per GEMM shape and per causal attention

GEMMs at Llama shapes ([8192 tokens, in] x [in, out]); causal GQA attention (32 query heads over
8 kv heads) forward and forward + backward, FLOPs counted as executed: 2 x S x heads x head_dim
per token forward (the causal half), 2.5 times that backward.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sdpa_kernels import ms_per_call  # noqa: E402

GEMMS = ((8192, 2048, 8192), (8192, 4096, 14336), (8192, 14336, 4096), (8192, 4096, 4096),
         (2048, 2048, 2048), (8192, 2048, 128256))  # fmt: skip
ATTENTION = ((8192, 64), (8192, 128), (16384, 64), (4096, 128))  # (seq_len, head_dim)


def seconds(fn, iters: int = 20) -> float:
    return ms_per_call(fn, iters) / 1e3


def gemm_tflops(m: int, k: int, n: int) -> float:
    kw = dict(device="cuda", dtype=torch.bfloat16)
    a, b = torch.randn(m, k, **kw), torch.randn(k, n, **kw)
    return 2 * m * k * n / seconds(lambda: a @ b) / 1e12


def attention_tflops(s: int, hd: int) -> tuple[float, float]:
    """(forward, forward + backward) TFLOP/s of causal GQA attention over s tokens."""
    kw = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, kv = torch.randn(1, 32, s, hd, **kw), torch.randn(1, 8, s, hd, **kw)
    flops = 2 * s * s * 32 * hd  # forward, causal half

    def fwd():
        return F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)

    both = seconds(lambda: fwd().sum().backward())
    return flops / seconds(fwd) / 1e12, 3.5 * flops / both / 1e12


def main() -> int:
    help_only = argparse.RawDescriptionHelpFormatter  # --help prints the docstring; no options
    argparse.ArgumentParser(description=__doc__, formatter_class=help_only).parse_args()
    if not torch.cuda.is_available():
        print("gpu_peaks: no CUDA GPU visible: nothing to measure.")
        return 0
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for m, k, n in GEMMS:
        out[f"mm_{m}x{k}x{n}_tflops"] = round(gemm_tflops(m, k, n), 1)
    for s, hd in ATTENTION:
        fwd, both = attention_tflops(s, hd)
        out[f"sdpa_fwd_s{s}_hd{hd}_tflops"] = round(fwd, 1)
        out[f"sdpa_fwdbwd_s{s}_hd{hd}_tflops"] = round(both, 1)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
