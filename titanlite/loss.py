"""Cross-entropy losses returning the fp32 SUM over non-ignored tokens.

The trainer divides by the global token count itself (one all-reduce per step), so every loss here
returns a sum, never a mean: microbatches and ranks can then be added exactly.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
# Vocab rows per block of the chunked loss's backward are a multiple of this (GEMM tiles).
_VOCAB_ROWS = 128


class VocabShard(NamedTuple):
    """Which rows of the output layer this process holds, and how to combine per-token values
    with the processes holding the rest of the vocabulary (in place, returning the tensor).

    The loss knows nothing of ranks: tensor parallelism passes a shard whose reductions are
    all-reduces over its group (models/decoder/tp_loss.py); one process holds the whole vocab.
    """

    vocab_start: int
    all_max: Callable[[torch.Tensor], torch.Tensor]
    all_sum: Callable[[torch.Tensor], torch.Tensor]


WHOLE_VOCAB = VocabShard(0, lambda t: t, lambda t: t)


def by_source(token_losses: torch.Tensor, labels: torch.Tensor, row_sources: torch.Tensor):
    """Per-source sums of per-token losses [N] (0 where ignored), detached: each row's sum
    [b] times the rows' one-hot sources [b, n] -> [n] (fp32: FSDP casts a forward's float
    inputs, these too, to the compute dtype; 0 and 1 survive it). A plain tensor also under
    loss parallel (every TP rank holds every token's loss)."""
    local = token_losses.to_local() if hasattr(token_losses, "to_local") else token_losses
    return local.detach().view(labels.shape[0], -1).sum(1) @ row_sources.float()


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, row_sources=None):
    """Sum of per-token cross-entropy; logits [..., V], labels [...] with IGNORE_INDEX skipped.
    With `row_sources` (the rows' one-hot sources [b, n], a mixture's), returns (sum, per-source
    sums [n]) from the same per-token losses."""
    # Upcast: bf16 logsumexp over a 128k vocab loses too much precision.
    flat = logits.flatten(0, -2).float()  # [..., V] -> [N, V]
    if row_sources is None:
        return F.cross_entropy(flat, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    per_token = F.cross_entropy(flat, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return per_token.sum(), by_source(per_token, labels, row_sources)


def _chunk_logits(h_c: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # The matmul runs in the input dtype (fast); only this chunk's result is upcast.
    return (h_c @ weight.T).float()  # [t, d] @ [d, V_local] -> [t, V_local] fp32


def _local_targets(y: torch.Tensor, vocab_start: int, local_vocab: int):
    """Labels as indices into this rank's vocab slice, and which of them fall inside it."""
    local_y = y - vocab_start
    # Ignored (-100) and other ranks' labels are out of range: clamp to index safely, then mask.
    mine = (y != IGNORE_INDEX) & (local_y >= 0) & (local_y < local_vocab)
    return local_y.clamp(0, local_vocab - 1), mine


def _add_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out (fp32) += a @ b, where a and b are in the input dtype."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)  # in place, no temporary
    else:
        out += a @ b  # low-precision product, promoted to fp32 as it is added


def _grad_logits(h_c, w_b, y, lse_c, scale_c, vocab_start) -> torch.Tensor:
    """scale * (softmax - onehot(y)) for one tile [t, Vb], in the input dtype.

    Built in place in the recomputed fp32 logits; the per-token lse makes a vocab slice's softmax
    independent of the rest of the vocab.
    """
    probs = _chunk_logits(h_c, w_b)  # [t, Vb]
    probs.sub_(lse_c.unsqueeze(1)).exp_()
    idx, mine = _local_targets(y, vocab_start, w_b.shape[0])
    probs[torch.arange(len(y), device=y.device), idx] -= mine.float()
    probs.mul_(scale_c.unsqueeze(1))
    return probs.to(h_c.dtype)  # the matmuls run in the input dtype


class _LinearCrossEntropySum(torch.autograd.Function):
    """sum_i CE(h_i @ W.T, y_i), chunk by chunk, saving only h, W, labels and per-token logsumexp.

    No chunk's logits survive the forward; backward recomputes them tile by tile (vocab blocks x
    token chunks), so activation memory is O(chunk_tokens x vocab) instead of O(N x vocab), and
    the fp32 gradient accumulators add O(N x d) plus one block. `weight` holds rows
    [shard.vocab_start, shard.vocab_start + V_local) of the vocabulary; the per-token max, sum of
    exponentials and target logit are combined with the other shards through `shard`.
    """

    @staticmethod
    def forward(ctx, h, weight, labels, chunk_tokens, shard: VocabShard, token_losses=None):
        # h [N, d], weight [V_local, d], labels [N]; token_losses [N] (optional) gets each
        # token's loss, outside autograd (a mixture's per-source sums)
        n, local_vocab = h.shape[0], weight.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, n, chunk_tokens):
            end = min(start + chunk_tokens, n)
            logits = _chunk_logits(h[start:end], weight)  # [t, V_local]
            y = labels[start:end]
            idx, mine = _local_targets(y, shard.vocab_start, local_vocab)
            target = torch.where(mine, logits.gather(1, idx.unsqueeze(1)).squeeze(1), 0.0)
            m = shard.all_max(logits.amax(dim=1))  # [t]
            # exp in place: the chunk's logits are not needed after this.
            sumexp = logits.sub_(m.unsqueeze(1)).exp_().sum(dim=1)  # [t]
            both = shard.all_sum(torch.stack([sumexp, target]))  # [2, t]
            chunk_lse = m + both[0].log()
            losses = torch.where(y != IGNORE_INDEX, chunk_lse - both[1], 0.0)
            total += losses.sum()
            if token_losses is not None:
                token_losses[start:end] = losses
            lse[start:end] = chunk_lse
        ctx.chunk_tokens, ctx.shard = chunk_tokens, shard
        ctx.save_for_backward(h, weight, labels, lse)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        h, weight, labels, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        (n, d), vocab, step = h.shape, weight.shape[0], ctx.chunk_tokens
        # Ignored tokens contribute nothing; grad_out carries the trainer's loss scale.
        scale = torch.where(labels != IGNORE_INDEX, grad_out, 0.0)  # [N] fp32
        # Gradients are summed in fp32 (adding many small chunk products in bf16 loses them).
        # Vocab blocks are the outer loop so that grad_w's fp32 accumulator covers one block, sized
        # to be no larger than a chunk's fp32 logits, instead of a whole fp32 [V, d]. A whole
        # number of _VOCAB_ROWS rows: the block is the leading dimension of the chunk's logit
        # gradients, and an odd one (3B: 2048 * 100,352 // 3,072 = 66,901) sends all three of
        # the backward's GEMMs to cuBLAS's unaligned kernels (on an H200: ~130 TFLOP/s against
        # ~800: 46% of the GPU time of a step of 8 of 3B's blocks).
        block = max(_VOCAB_ROWS, step * vocab // d // _VOCAB_ROWS * _VOCAB_ROWS)
        grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        for v0 in range(0, vocab, block):
            w_b, w_start = weight[v0 : v0 + block], ctx.shard.vocab_start + v0  # [Vb, d]
            acc = torch.zeros(w_b.shape, dtype=torch.float32, device=h.device) if need_w else None
            for start in range(0, n, step):
                sl, h_c = slice(start, start + step), h[start : start + step]  # t <= step tokens
                g = _grad_logits(h_c, w_b, labels[sl], lse[sl], scale[sl], w_start)
                if need_h:
                    _add_mm(grad_h[sl], g, w_b)
                if need_w:
                    _add_mm(acc, g.T, h_c)
            if need_w:
                grad_w[v0 : v0 + block] = acc  # cast to the weight dtype
        if need_h:
            # Each rank's vocab slice contributes a partial dL/dh; h is replicated, so sum them.
            grad_h = ctx.shard.all_sum(grad_h).to(h.dtype)
        return grad_h, grad_w, None, None, None, None


def linear_cross_entropy_sum(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    shard: VocabShard = WHOLE_VOCAB,
    row_sources: torch.Tensor | None = None,
):
    """Equal to cross_entropy_sum(h @ weight.T, labels[, row_sources]), computed chunk_tokens
    tokens at a time.

    h [b, s, d] or [N, d], weight [V_local, d], labels [b, s] or [N] in [0, V) or IGNORE_INDEX.
    The data loader checks the label range on the CPU: checking here would cost a device sync
    per call, and a label outside every shard would silently count as "another shard's".
    Returns an fp32 scalar, identical on every process sharing the vocabulary.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1 for the chunked loss, got {chunk_tokens}")
    flat_h = h.reshape(-1, h.shape[-1])  # [b, s, d] -> [N, d]
    flat_y = labels.reshape(-1)  # [b, s] -> [N]
    if row_sources is None:
        return _LinearCrossEntropySum.apply(flat_h, weight, flat_y, chunk_tokens, shard)
    token_losses = torch.empty(flat_y.shape, dtype=torch.float32, device=flat_y.device)
    total = _LinearCrossEntropySum.apply(flat_h, weight, flat_y, chunk_tokens, shard, token_losses)
    return total, by_source(token_losses, labels, row_sources)
