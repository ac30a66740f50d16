"""Chunked linear cross-entropy equals the plain loss and saves no O(N x V) tensor."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import titanlite.loss as loss_module
from titanlite.loss import IGNORE_INDEX, cross_entropy_sum, linear_cross_entropy_sum
from titanlite.loss import WHOLE_VOCAB as WHOLE

B, S, D, V = 2, 24, 16, 37  # N = 48 tokens


def make_inputs(dtype=torch.float32, seed=0, vocab=V):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, S, D, generator=g).to(dtype)
    w = (torch.randn(vocab, D, generator=g) * D**-0.5).to(dtype)
    labels = torch.randint(0, vocab, (B, S), generator=g)
    labels[0, :5] = IGNORE_INDEX
    labels[1, 10:13] = IGNORE_INDEX
    return h, w, labels


def loss_and_grads(fn, h, w, labels, scale=1.0):
    """Run fn(h, w, labels), backward of scale * loss; returns (loss, h.grad, w.grad)."""
    h = h.clone().requires_grad_()
    w = w.clone().requires_grad_()
    loss = fn(h, w, labels)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


def plain(h, w, labels):
    return cross_entropy_sum(h @ w.T, labels)


def chunked(chunk_tokens):
    return lambda h, w, labels: linear_cross_entropy_sum(h, w, labels, chunk_tokens)


# fp32 chunked vs plain, over the whole tensor: |got - want| <= FP32_RTOL x max|want|. Both sum
# the same products in different orders (w.grad: 48 tokens, chunk by chunk; h.grad: 37 vocab
# rows, block by block; logsumexp: 37 terms; logits: 16-term dots), so they differ by a few
# u = 2**-24 of the summed magnitudes, i.e. of the tensor's largest entry, not of each entry (an
# entry near zero by cancellation errs as much as a large one: a per-entry atol of 1e-6 is 3u of
# w.grad's largest entry, tighter than the numerics). About 100 roundings deep: <= 2 x 100u =
# 1.2e-5 worst case, ~2 sqrt(100) u = 1.2e-6 typically. Measured <= 3.5e-7 (loss, h.grad, w.grad,
# every test here): 57x margin; a chunking or scale bug is O(1e-2) or more.
FP32_RTOL = 2e-5


def assert_close_fp32(got, want):
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    err, size = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= FP32_RTOL * size, f"max|got - want| {err:.2e}, max|want| {size:.2e}"


def test_cross_entropy_sum_is_the_sum_over_kept_tokens():
    h, w, labels = make_inputs()
    logits = (h @ w.T).to(torch.bfloat16)
    loss = cross_entropy_sum(logits, labels)
    kept = labels != IGNORE_INDEX
    expected = F.cross_entropy(logits.float()[kept], labels[kept], reduction="sum")
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, expected)


# 1 and 7 do not divide N = 48; 48 is one chunk; 1000 is larger than N. V = 37 is one backward
# vocab block (test_backward_vocab_blocks_are_whole_tiles splits the vocabulary).
@pytest.mark.parametrize("chunk_tokens", [1, 7, 16, 48, 1000])
def test_chunked_equals_plain_fp32(chunk_tokens):
    h, w, labels = make_inputs()
    # The trainer scales the returned sum before backward: grad_output is not 1.
    ref = loss_and_grads(plain, h, w, labels, scale=0.37)
    out = loss_and_grads(chunked(chunk_tokens), h, w, labels, scale=0.37)
    assert out[0].dtype == torch.float32 and out[0].shape == ()
    for got, want in zip(out, ref, strict=True):
        assert_close_fp32(got, want)


# The backward walks the vocabulary in blocks of about chunk * V / D rows, rounded down to whole
# 128-row tiles: V = 300, D = 16: chunk 7 -> 131 -> 128 rows (blocks 128, 128, 44), chunk 16 ->
# 300 -> 256 (256, 44). An untiled block (131 rows) would be the leading dimension of the logit
# gradients; odd ones sent 3B's loss GEMMs to cuBLAS's unaligned kernels on GPUs.
@pytest.mark.parametrize(("chunk_tokens", "blocks"), [(7, [128, 128, 44]), (16, [256, 44])])
def test_backward_vocab_blocks_are_whole_tiles(chunk_tokens, blocks, monkeypatch):
    rows = []

    def recording(h_c, w_b, *args):
        rows.append(w_b.shape[0])
        return grad_logits(h_c, w_b, *args)

    grad_logits = loss_module._grad_logits
    monkeypatch.setattr(loss_module, "_grad_logits", recording)
    h, w, labels = make_inputs(vocab=300)
    ref = loss_and_grads(plain, h, w, labels, scale=0.37)
    out = loss_and_grads(chunked(chunk_tokens), h, w, labels, scale=0.37)
    for got, want in zip(out, ref, strict=True):
        assert_close_fp32(got, want)
    token_chunks = -(-B * S // chunk_tokens)
    assert rows == [n for n in blocks for _ in range(token_chunks)]


def test_flat_tokens_input():
    h, w, labels = make_inputs()
    flat = (h.reshape(B * S, D), w, labels.reshape(B * S))  # [b, s, d] -> [N, d]
    ref = loss_and_grads(plain, *flat)
    out = loss_and_grads(chunked(10), *flat)
    for got, want in zip(out, ref, strict=True):
        assert_close_fp32(got, want)


def test_ignored_chunks_and_all_ignored():
    h, w, labels = make_inputs()
    labels[0, :] = IGNORE_INDEX  # tokens 0..23: the first chunks of 8 have no target at all
    ref = loss_and_grads(plain, h, w, labels)
    out = loss_and_grads(chunked(8), h, w, labels)
    for got, want in zip(out, ref, strict=True):
        assert_close_fp32(got, want)
    assert out[1][0].abs().max() == 0  # ignored tokens get exactly zero gradient

    loss, gh, gw = loss_and_grads(chunked(8), h, w, torch.full_like(labels, IGNORE_INDEX))
    assert loss.item() == 0.0 and gh.abs().max() == 0 and gw.abs().max() == 0


def test_bf16_inputs_give_bf16_grads_close_to_plain():
    h, w, labels = make_inputs(torch.bfloat16)
    ref = loss_and_grads(plain, h, w, labels, scale=2.0)
    out = loss_and_grads(chunked(7), h, w, labels, scale=2.0)
    assert out[0].dtype == torch.float32
    assert out[1].dtype == torch.bfloat16 and out[2].dtype == torch.bfloat16
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-4)
    for got, want in zip(out[1:], ref[1:], strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_grad_only_for_h():
    h, w, labels = make_inputs()
    h.requires_grad_()
    linear_cross_entropy_sum(h, w, labels, 5).backward()
    ref_h = loss_and_grads(plain, h.detach(), w, labels)[1]
    assert_close_fp32(h.grad, ref_h)


def saved_bytes(fn, h, w, labels):
    """Bytes saved for backward by fn, not counting storage shared with the inputs."""
    inputs = {t.untyped_storage().data_ptr() for t in (h, w, labels)}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in inputs:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(h, w, labels)
    return sum(seen.values())


def test_chunked_saves_no_logits():
    n_tok, vocab, chunk = 256, 1000, 32
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n_tok, D, generator=g, requires_grad=True)
    w = torch.randn(vocab, D, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (n_tok,), generator=g)
    one_chunk_logits = chunk * vocab * 4  # fp32
    assert saved_bytes(chunked(chunk), h, w, labels) < one_chunk_logits  # only lse [N] fp32
    assert saved_bytes(plain, h, w, labels) >= n_tok * vocab * 4  # the full log-softmax


def test_bad_chunk_tokens():
    h, w, labels = make_inputs()
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_cross_entropy_sum(h, w, labels, 0)


def peak_bytes_allocated(fn, trace: Path) -> int:
    """The most bytes fn's CPU allocations held at once, beyond what existed before it (from the
    profiler's allocation records, which its trace file lists in order)."""
    with torch.profiler.profile(profile_memory=True) as prof:
        fn()
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    held = peak = 0
    for event in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        held += event["args"]["Bytes"]
        peak = max(peak, held)
    return peak


def test_compiled_plain_loss_keeps_only_the_logits_gradient(tmp_path):
    """What the memory estimator counts for the plain loss: eager, the fp32 upcast, its
    log-softmax and their gradients (measured 10-12 more bytes per bf16 logit; the estimator
    counts 12); compiled (parallelize.apply_compile), only the logits' bf16 gradient (2)."""
    n, vocab = 256, 4096
    logits = torch.randn(n, vocab).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (n,))
    compiled = torch.compile(cross_entropy_sum)

    def step(fn):
        logits.grad = None
        fn(logits, labels).backward()

    step(compiled)  # compile outside the measurement
    logit_bytes = n * vocab * 2
    trace = tmp_path / "trace.json"
    assert peak_bytes_allocated(lambda: step(cross_entropy_sum), trace) >= 4 * logit_bytes
    eager = logits.grad.clone()
    assert peak_bytes_allocated(lambda: step(compiled), trace) <= 1.1 * logit_bytes
    # Both round the same fp32 softmax gradient to bf16; fused, its fp32 terms are summed in
    # another order, which may move a rounding across one bf16 step (up to 2**-7 relative).
    torch.testing.assert_close(logits.grad, eager, rtol=2**-7, atol=0)


@pytest.mark.parametrize("chunk_tokens", [0, 7, 1000])  # 0: the plain loss
def test_per_source_sums_are_the_rows_losses_and_leave_the_gradients_alone(chunk_tokens):
    """With a mixture's row sources (row 0 from source 2, row 1 from source 0, none from 1) the
    loss also returns each source's summed loss, from the same per-token losses: each equals its
    rows' loss alone; the loss and gradients are those without sources."""
    h, w, labels = make_inputs()
    rows = F.one_hot(torch.tensor([2, 0]), 3).bfloat16()  # as FSDP's bf16 input cast gives them
    fn = plain if chunk_tokens == 0 else chunked(chunk_tokens)
    ref = loss_and_grads(fn, h, w, labels, scale=0.37)
    sums = []

    def with_sources(h, w, labels):
        if chunk_tokens == 0:
            total, by_source = cross_entropy_sum(h @ w.T, labels, row_sources=rows)
        else:
            total, by_source = linear_cross_entropy_sum(h, w, labels, chunk_tokens, WHOLE, rows)
        sums.append(by_source)
        return total

    out = loss_and_grads(with_sources, h, w, labels, scale=0.37)
    for got, want in zip(out, ref, strict=True):
        assert_close_fp32(got, want)
    (by_source,) = sums
    assert not by_source.requires_grad and by_source.shape == (3,)
    alone = [fn(h[i : i + 1], w, labels[i : i + 1]).detach() for i in range(B)]
    assert_close_fp32(by_source, torch.stack([alone[1], torch.tensor(0.0), alone[0]]))
