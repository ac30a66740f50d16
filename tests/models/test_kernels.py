"""The generic (GPU) path of each kernel in titanlite/models/kernels.py, forced on CPU, against
the CPU path.

Both paths approximate the same exact result: each is compared with an fp64 reference, and the
two with each other, in units of `u`, the error of rounding the exact result once to the
inputs' dtype (whole tensors, norms). A path whose error is at most a*u and one at most b*u are
at most (a + b)*u apart; a and b are the bounds each path keeps on its own (see each test).
"""

import contextlib
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from titanlite.models import kernels
from titanlite.models.decoder.model import Transformer
from titanlite.models.llama.args import get_model_args


def _rounding(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (exact.to(dtype).double() - exact).norm()


def _run(fn, inputs, grad_out, generic: bool):
    """fn's output and its inputs' gradients, by the CPU path or the forced generic one."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    if generic:
        with kernels.generic_kernels():
            out = fn(*leaves)
    else:
        out = fn(*leaves)
    out.backward(grad_out)
    return [out.detach(), *(t.grad for t in leaves)]


def _check(fn, exact_fn, inputs, grad_out, cpu_bound, generic_bound):
    dtype = inputs[0].dtype
    cpu = _run(fn, inputs, grad_out, generic=False)
    generic = _run(fn, inputs, grad_out, generic=True)
    exact = _run(exact_fn, [t.double() for t in inputs], grad_out.double(), generic=False)
    for name, c, g, ref in zip(("out", *map(str, range(len(inputs)))), cpu, generic, exact):
        u = _rounding(ref, dtype)
        assert c.dtype == g.dtype == dtype, name
        assert (c.double() - ref).norm() <= cpu_bound * u, name
        assert (g.double() - ref).norm() <= generic_bound * u, name
        assert (c.double() - g.double()).norm() <= (cpu_bound + generic_bound) * u, name


def test_generic_kernels_select_the_gpu_choices_on_cpu():
    q = torch.empty(1, 4, 8, 16, dtype=torch.bfloat16)
    assert not kernels.native_gqa(q.device) and kernels.fp32_backward(q)
    with kernels.generic_kernels():
        assert kernels.native_gqa(q.device) and not kernels.fp32_backward(q)
    assert not kernels.native_gqa(q.device) and kernels.fp32_backward(q)


def _attention_inputs(dtype, n_kv_heads, masked):
    g = torch.Generator().manual_seed(0)
    q, grad_out = (torch.randn(2, 8, 64, 16, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(2, n_kv_heads, 64, 16, generator=g).to(dtype) for _ in range(2))
    mask = None
    if masked:
        doc = (torch.arange(64) >= 20).long().repeat(2, 1)  # documents of 20 and 44 tokens
        mask = (doc[:, :, None] == doc[:, None, :]).tril().unsqueeze(1)
    return (q, k, v), grad_out, mask


def _exact_attention(mask):
    def attend(q, k, v):
        n_rep = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(n_rep, dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)

    return attend


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("n_kv_heads", [8, 2])
@pytest.mark.parametrize(
    ("dtype", "cpu_bound", "generic_bound"),
    [
        # bf16: the CPU path rounds each gradient once from fp32 (within 1.5 u, as
        # tests/models/llama/test_model.py holds it); the generic path is SDPA's bf16 kernel,
        # which rounds inside too (K and V summed over query heads in bf16 under enable_gqa):
        # up to 2.6 u measured, held to 3 u.
        (torch.bfloat16, 1.5, 3.0),
        # fp32: fp32 kernels in their own summation orders, a sum of n terms about sqrt(n)
        # roundings off: the scores over head_dim 16, the softmax's and the weighted sum's over
        # 64 keys, sqrt(16) + 2 sqrt(64) = 20 u each (measured: up to 10 u).
        (torch.float32, 20.0, 20.0),
    ],
)
def test_attention_generic_path_agrees_with_the_cpu_path(
    dtype, cpu_bound, generic_bound, n_kv_heads, masked
):
    inputs, grad_out, mask = _attention_inputs(dtype, n_kv_heads, masked)
    attend = lambda q, k, v: kernels.sdpa(q, k, v, mask)  # noqa: E731
    _check(attend, _exact_attention(mask), inputs, grad_out, cpu_bound, generic_bound)


@pytest.mark.parametrize(
    ("dtype", "cpu_bound", "generic_bound"),
    [
        # bf16: the CPU path's closed form in fp32, rounded once (1.5 u, its own test's
        # bound); torch's composite rounds its bf16 products along the way: held to 3 u.
        (torch.bfloat16, 1.5, 3.0),
        # fp32: the mean of squares over 64 elements, about sqrt(64) = 8 roundings off, each
        # (measured: up to 3.3 u).
        (torch.float32, 8.0, 8.0),
    ],
)
def test_rms_norm_generic_path_agrees_with_the_cpu_path(dtype, cpu_bound, generic_bound):
    g = torch.Generator().manual_seed(0)
    x, grad_out = (3 * torch.randn(4, 16, 64, generator=g).to(dtype) for _ in range(2))
    weight = (0.5 + torch.rand(64, generator=g)).to(dtype)

    def exact(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    norm = lambda x, w: kernels.rms_norm(x, w, 1e-5)  # noqa: E731
    _check(norm, exact, (x, weight), grad_out, cpu_bound, generic_bound)
    # The forward is the same ops on either path: bitwise the same output.
    with kernels.generic_kernels():
        generic = kernels.rms_norm(x, weight, 1e-5)
    assert torch.equal(kernels.rms_norm(x, weight, 1e-5), generic)


def test_a_model_step_on_the_generic_path_matches_the_cpu_path():
    """The debug model in fp32 with GQA (4 kv heads of 16), forward and backward, by each path:
    every kernel differs in fp32 rounding only, so the loss and every gradient agree to fp32's
    default tolerance for a few roundings per op (rtol 1e-5)."""
    args = get_model_args("debugmodel", 512, max_seq_len=64, use_scaled_rope=False)
    args = replace(args, n_kv_heads=4)
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))

    def step(generic: bool):
        model = Transformer(args)
        model.init_weights(0)
        with kernels.generic_kernels() if generic else contextlib.nullcontext():
            loss = model(tokens, labels=tokens)
            loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    (cpu_loss, cpu_grads), (gen_loss, gen_grads) = step(False), step(True)
    torch.testing.assert_close(gen_loss, cpu_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(gen_grads, cpu_grads, rtol=1e-5, atol=1e-7)
