"""Which fused SDPA kernels take titanlite's attention calls on this GPU (bf16, forward + backward).

    python scripts/benchmarks/sdpa_kernels.py

A context-parallel rank attends its query chunk over the gathered keys with a boolean mask; SDPA
has no fused kernel for every mask + GQA combination, and falls back to the O(S^2) math kernel
where none applies. This asks each fused backend in turn (cuDNN, flash, memory-efficient) for the
CP call as titanlite makes it (K/V repeated to the query heads, with the mask), for the mask with
enable_gqa (which titanlite avoids), and for the unmasked causal call with enable_gqa; then times
titanlite's own `sdpa` on the CP call with torch's default dispatch against the math kernel.
Shapes: Llama 3 8B's heads (32 query, 8 kv, head dim 128), a 4,096-token chunk of 8,192.
Exit status 1 when a call titanlite makes reaches no fused kernel. Without a GPU: one line, exit 0.
"""

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from titanlite.models.kernels import sdpa

FUSED = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)


def fused_backends(q, k, **kwargs) -> list[str]:
    ok = []
    for backend in FUSED:
        a, b = q.clone().requires_grad_(), k.clone().requires_grad_()
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(a, b, b, **kwargs).sum().backward()
            ok.append(backend.name)
        except RuntimeError:  # this backend does not take the call
            pass
    return ok


def ms_per_call(fn, iters: int = 10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> int:
    help_only = argparse.RawDescriptionHelpFormatter  # --help prints the docstring; no options
    argparse.ArgumentParser(description=__doc__, formatter_class=help_only).parse_args()
    if not torch.cuda.is_available():
        print(f"sdpa_kernels: no CUDA GPU visible to torch {torch.__version__}: nothing to check.")
        return 0
    d = dict(device="cuda", dtype=torch.bfloat16)
    q, k = torch.randn(1, 32, 4096, 128, **d), torch.randn(1, 8, 8192, 128, **d)
    mask = torch.arange(8192, device="cuda") <= torch.arange(4096, 8192, device="cuda")[:, None]
    repeated = k.repeat_interleave(4, 1)
    cases = {  # name: (q, k, kwargs, titanlite makes this call)
        "CP chunk: bool mask, K/V repeated": (q, repeated, dict(attn_mask=mask), True),
        "CP chunk: bool mask + enable_gqa": (q, k, dict(attn_mask=mask, enable_gqa=True), False),
        "causal, enable_gqa": (q, k[:, :, :4096], dict(is_causal=True, enable_gqa=True), True),
    }  # fmt: skip
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    missing = False
    for name, (qq, kk, kwargs, used) in cases.items():
        ok = fused_backends(qq, kk, **kwargs)
        missing |= used and not ok
        print(f"{'fused' if ok else 'MATH ONLY'}: {name} {ok}{'' if used else ' (not used)'}")
    a, b = q.clone().requires_grad_(), k.clone().requires_grad_()
    torch.cuda.reset_peak_memory_stats()
    fused = ms_per_call(lambda: sdpa(a, b, b, mask).sum().backward())
    peak = torch.cuda.max_memory_allocated() / 2**30
    with sdpa_kernel([SDPBackend.MATH]):
        math = ms_per_call(lambda: sdpa(a, b, b, mask).sum().backward())
    print(f"titanlite sdpa, CP chunk: {fused:.2f} ms fwd+bwd (default dispatch, peak {peak:.2f} "
          f"GiB), {math:.2f} ms on the math kernel")  # fmt: skip
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
