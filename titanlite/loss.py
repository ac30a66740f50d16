"""Cross-entropy losses returning the fp32 SUM over non-ignored tokens.

The trainer divides by the global token count itself (one all-reduce per step), so every loss here
returns a sum, never a mean: microbatches and ranks can then be added exactly.
"""

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy; logits [..., V], labels [...] with IGNORE_INDEX skipped."""
    # Upcast: bf16 logsumexp over a 128k vocab loses too much precision.
    flat = logits.flatten(0, -2).float()  # [..., V] -> [N, V]
    return F.cross_entropy(flat, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


class _LinearCrossEntropySum(torch.autograd.Function):
    """sum_i CE(h_i @ W.T, y_i), chunk by chunk, saving only h, W, labels and per-token logsumexp.

    No chunk's logits survive the forward; backward recomputes them, so activation memory is
    O(chunk_tokens x vocab) instead of O(N x vocab).
    """

    @staticmethod
    def forward(ctx, h, weight, labels, chunk_tokens):
        # h [N, d], weight [V, d], labels [N]
        n = h.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, n, chunk_tokens):
            end = min(start + chunk_tokens, n)
            logits = (h[start:end] @ weight.T).float()  # [t, V]
            chunk_lse = torch.logsumexp(logits, dim=-1)  # [t]
            y = labels[start:end]
            valid = y != IGNORE_INDEX
            # Ignored labels (-100) are not valid indices: gather at 0, then mask out.
            target = logits.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)  # [t]
            total += torch.where(valid, chunk_lse - target, 0.0).sum()
            lse[start:end] = chunk_lse
        ctx.chunk_tokens = chunk_tokens
        ctx.save_for_backward(h, weight, labels, lse)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        h, weight, labels, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        # fp32 accumulator: summing many chunk products in bf16 would lose the small ones.
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_w = grad_w if need_w else None
        n, step = h.shape[0], ctx.chunk_tokens
        for start in range(0, n, step):
            end = min(start + step, n)
            h_c, y = h[start:end], labels[start:end]
            valid = y != IGNORE_INDEX
            # dCE/dlogits = softmax - onehot(y), built in place in the recomputed fp32 logits.
            probs = (h_c @ weight.T).float()  # [t, V]
            probs.sub_(lse[start:end].unsqueeze(1)).exp_()
            rows = torch.arange(end - start, device=h.device)
            probs[rows, y.clamp(min=0)] -= 1.0
            # Ignored tokens contribute nothing; grad_out carries the trainer's loss scale.
            probs.mul_((valid.float() * grad_out).unsqueeze(1))
            g = probs.to(h.dtype)  # [t, V]; matmuls run in the input dtype
            if need_h:
                torch.mm(g, weight, out=grad_h[start:end])
            if need_w and g.dtype == torch.float32:
                grad_w.addmm_(g.T, h_c)  # in place: no [V, d] temporary
            elif need_w:
                grad_w += (g.T @ h_c).float()  # [V, d] in the input dtype, summed in fp32
        grad_w = grad_w.to(weight.dtype) if need_w else None
        return grad_h, grad_w, None, None


def linear_cross_entropy_sum(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """Equal to cross_entropy_sum(h @ weight.T, labels), computed chunk_tokens tokens at a time.

    h [b, s, d] or [N, d], weight [V, d], labels [b, s] or [N]; returns an fp32 scalar.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1 for the chunked loss, got {chunk_tokens}")
    if isinstance(h, DTensor) or isinstance(weight, DTensor):
        raise ValueError(
            "loss.chunk_tokens > 0 is not supported with tensor_parallel_degree > 1 "
            "(the output weight is a DTensor); set --loss.chunk_tokens 0"
        )
    flat_h = h.reshape(-1, h.shape[-1])  # [b, s, d] -> [N, d]
    return _LinearCrossEntropySum.apply(flat_h, weight, labels.reshape(-1), chunk_tokens)
