"""Chunked linear cross-entropy equals the plain loss, saves no O(N x V) tensor, works under TP."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from titanlite.loss import IGNORE_INDEX, cross_entropy_sum, linear_cross_entropy_sum

B, S, D, V = 2, 24, 16, 37  # N = 48 tokens


def make_inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, S, D, generator=g).to(dtype)
    w = (torch.randn(V, D, generator=g) * D**-0.5).to(dtype)
    labels = torch.randint(0, V, (B, S), generator=g)
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


def test_cross_entropy_sum_is_the_sum_over_kept_tokens():
    h, w, labels = make_inputs()
    logits = (h @ w.T).to(torch.bfloat16)
    loss = cross_entropy_sum(logits, labels)
    kept = labels != IGNORE_INDEX
    expected = F.cross_entropy(logits.float()[kept], labels[kept], reduction="sum")
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, expected)


# 1 and 7 do not divide N = 48 and also split the vocab into backward blocks (block = chunk * V // D
# rows: 2 and 16 of 37); 48 is one chunk; 1000 is larger than N.
@pytest.mark.parametrize("chunk_tokens", [1, 7, 16, 48, 1000])
def test_chunked_equals_plain_fp32(chunk_tokens):
    h, w, labels = make_inputs()
    # The trainer scales the returned sum before backward: grad_output is not 1.
    ref = loss_and_grads(plain, h, w, labels, scale=0.37)
    out = loss_and_grads(chunked(chunk_tokens), h, w, labels, scale=0.37)
    assert out[0].dtype == torch.float32 and out[0].shape == ()
    for got, want in zip(out, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_flat_tokens_input():
    h, w, labels = make_inputs()
    flat = (h.reshape(B * S, D), w, labels.reshape(B * S))  # [b, s, d] -> [N, d]
    ref = loss_and_grads(plain, *flat)
    out = loss_and_grads(chunked(10), *flat)
    for got, want in zip(out, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_ignored_chunks_and_all_ignored():
    h, w, labels = make_inputs()
    labels[0, :] = IGNORE_INDEX  # tokens 0..23: the first chunks of 8 have no target at all
    ref = loss_and_grads(plain, h, w, labels)
    out = loss_and_grads(chunked(8), h, w, labels)
    for got, want in zip(out, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
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
    torch.testing.assert_close(h.grad, ref_h, rtol=1e-5, atol=1e-6)


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


def test_bad_chunk_tokens_and_labels():
    h, w, labels = make_inputs()
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_cross_entropy_sum(h, w, labels, 0)
    for bad in (V, -1):
        labels[1, 3] = bad
        with pytest.raises(ValueError, match=f"got \\[{bad}\\]"):
            linear_cross_entropy_sum(h, w, labels, 8)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank, world, port):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    # vocab 37 over 2 ranks shards unevenly (19 + 18 rows); 7 does not divide N = 48.
    for vocab, chunk_tokens in [(37, 7), (40, 48)]:
        g = torch.Generator().manual_seed(vocab)
        h = torch.randn(B, S, D, generator=g)
        w = torch.randn(vocab, D, generator=g) * D**-0.5
        labels = torch.randint(0, vocab, (B, S), generator=g)
        labels[0, :5] = IGNORE_INDEX
        # As under the TP plan: sequence-parallel hidden states, vocab-sharded output weight.
        h_dt = distribute_tensor(h, mesh, [Shard(1)]).requires_grad_()
        w_dt = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
        loss = linear_cross_entropy_sum(h_dt, w_dt, labels, chunk_tokens)
        (loss * 0.5).backward()
        ref = loss_and_grads(plain, h, w, labels, scale=0.5)
        got = (loss.detach(), h_dt.grad.full_tensor(), w_dt.grad.full_tensor())
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    dist.destroy_process_group()


def test_tensor_parallel_matches_plain():
    # A failure in either rank re-raises here with that rank's traceback.
    mp.spawn(_tp_worker, args=(2, _free_port()), nprocs=2)
