"""The model's device-specific kernels: attention and RMSNorm, each chosen by its tensors' device.

Each op has a generic path, what a GPU runs (torch's fused kernels, differentiated by autograd),
and a CPU path where torch's CPU kernels are slower or less exact. Under `generic_kernels()` CPU
tensors take the generic path too, so the CPU test suite runs what a GPU runs and compares the
two (tests/models/test_kernels.py). The measurements behind each CPU choice are in
docs/kernels.md.
"""

import contextlib
import math

import torch
import torch.nn.functional as F

from titanlite.torch_compat import cpu_flash_attention_ops

_force_generic = False


@contextlib.contextmanager
def generic_kernels():
    """Run the generic (GPU) path of every kernel here on every device, CPU included."""
    global _force_generic
    before, _force_generic = _force_generic, True
    try:
        yield
    finally:
        _force_generic = before


def _cpu_path(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and not _force_generic


# -- attention -----------------------------------------------------------------------------------


def sdpa(q, k, v, mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA of q [b, hq, sq, hd] over k, v [b, hkv, skv, hd] -> [b, hq, sq, hd]: causal (sq ==
    skv), or where the bool `mask` [.., sq, skv] is True.

    GQA: query head j attends with kv head j // n_rep (Meta's repeat_kv order; SDPA's enable_gqa
    and flex's too). Without a mask, where native_gqa holds, SDPA reads the kv heads in place
    (enable_gqa: the flash and cuDNN kernels do GQA natively, with no n_rep-fold copy of K and V
    to write and keep for backward). With a mask K and V are repeated to hq heads first: no fused
    CUDA kernel of torch 2.11 takes a mask together with GQA when cuDNN's is not chosen (flash
    takes no mask, memory-efficient no GQA), and SDPA's math fallback materializes every score
    [b, hq, sq, skv].
    """
    n_rep = q.shape[1] // k.shape[1]
    if mask is None and native_gqa(q.device):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_rep > 1)
    if fp32_backward(q):
        return CpuFlashFp32Backward.apply(
            q, k, v, None if mask is None else additive_bias(mask, q.dtype)
        )
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)


def native_gqa(device: torch.device) -> bool:
    """Whether unmasked SDPA takes K and V with their kv heads (enable_gqa) on `device`: not on
    CPU, whose flash kernel's bf16 backward sums the query heads' K and V gradients less exactly
    than the repeated form's (docs/kernels.md)."""
    return device.type != "cpu" or _force_generic


def fp32_backward(q: torch.Tensor) -> bool:
    """Whether attention's backward runs in fp32 (CpuFlashFp32Backward): for bf16 on CPU at
    head_dim <= 64, where torch's bf16 CPU flash backward is less exact and no faster
    (docs/kernels.md)."""
    return _cpu_path(q) and q.dtype == torch.bfloat16 and q.shape[-1] <= 64


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[b, hkv, s, hd] -> [b, hkv * n_rep, s, hd], each kv head repeated for its query heads."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def additive_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = attend) as SDPA applies it: 0 where True, -inf elsewhere."""
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(~mask, -math.inf)


class CpuFlashFp32Backward(torch.autograd.Function):
    """Attention of q [b, hq, s, hd] over k, v [b, hkv, s, hd] by torch's CPU flash kernel,
    causal (bias None) or with an additive bias. The forward is SDPA's, bitwise, in the inputs'
    dtype; the backward runs the same kernel's backward in fp32, sums the query heads' K and V
    gradients in fp32 and rounds each gradient once. It keeps what SDPA with repeated K and V
    keeps for backward (q, the repeated k and v, the bias, out, logsumexp)."""

    @staticmethod
    def forward(ctx, q, k, v, bias):
        n_rep = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        flash, _ = cpu_flash_attention_ops()
        out, lse = flash(q, k, v, 0.0, bias is None, attn_mask=bias)
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.n_rep = n_rep
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, bias, out, lse = ctx.saved_tensors
        _, flash_backward = cpu_flash_attention_ops()
        fp32 = [t.float() for t in (grad_out, q, k, v, out)]
        bias = None if bias is None else bias.float()
        dq, dk, dv = flash_backward(*fp32, lse, 0.0, bias is None, attn_mask=bias)
        if ctx.n_rep > 1:  # [b, hkv * n_rep, s, hd] -> [b, hkv, s, hd]: query heads adjacent
            dk, dv = (g.unflatten(1, (-1, ctx.n_rep)).sum(2) for g in (dk, dv))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


# -- RMSNorm -------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    """RMSNorm of x over its last dim, times `weight` (nn.RMSNorm's forward, bitwise).

    Generic: torch's op (one fused kernel each way on a GPU; inside compiled blocks inductor
    fuses the composite). On CPU eager, CpuRMSNorm: the same forward ops, with a closed-form
    fp32 backward that keeps less and is faster than autograd's through the composite
    (docs/kernels.md).
    """
    if not _cpu_path(x) or torch.compiler.is_compiling():
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return CpuRMSNorm.apply(x, weight, torch.finfo(x.dtype).eps if eps is None else eps)


class CpuRMSNorm(torch.autograd.Function):
    """The forward keeps only the input and an fp32 rstd per row (what CUDA's fused kernel
    keeps); the backward is the closed form in fp32, rounded once."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()  # x itself when x is fp32: nothing below writes into it
        rstd = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()  # [..., 1]
        ctx.save_for_backward(x, weight, rstd)
        return torch.mul(xf, rstd).mul_(weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        # y = xhat * w, xhat = x * rstd: dx = rstd * (g w - xhat * mean(g w xhat)), dw = sum g xhat.
        # Every operand is made fp32 first: torch's CPU kernels for bf16 x fp32 are unvectorized.
        x, weight, rstd = ctx.saved_tensors
        g = grad.float()
        xhat = x.to(torch.float32, copy=True).mul_(rstd)
        dw = None
        if ctx.needs_input_grad[1]:
            dw = torch.mul(g, xhat).sum(tuple(range(x.dim() - 1))).to(weight.dtype)
        gw = g * weight.float()
        mean = torch.mul(gw, xhat).mean(-1, keepdim=True)
        dx = gw.sub_(xhat.mul_(mean)).mul_(rstd)
        return dx.to(x.dtype), dw, None
