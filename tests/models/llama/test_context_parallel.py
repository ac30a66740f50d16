"""Context-parallel attention equals full causal attention, outputs and input gradients."""

import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port

from titanlite.distributed import destroy
from titanlite.models.decoder.context_parallel import cp_attention, split_sequence
from titanlite.models.decoder.model import (
    causal_attention,
    document_block_mask,
    document_causal_mask,
)

# (sequence length, query heads, kv heads): MHA, GQA 2 and 8, and lengths that make chunks of
# 1, 3 and 5 tokens at CP 4.
CASES = [(8, 4, 4), (24, 4, 2), (40, 8, 1)]


def _attention_and_grads(attend, q, k, v, grad_out):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def _ragged_documents(batch: int, seq_len: int, g) -> torch.Tensor:
    """[batch, seq_len] document ids, a new document at each position with chance 1/4: documents
    of every length cross chunk (and so CP rank) borders, one-token ones among them."""
    starts = torch.rand(batch, seq_len, generator=g) < 0.25
    return starts.long().cumsum(1)


def _worker(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.group.WORLD
    for seq_len, hq, hkv in CASES:
        g = torch.Generator().manual_seed(seq_len)
        q = torch.randn(2, hq, seq_len, 16, generator=g)
        k, v = (torch.randn(2, hkv, seq_len, 16, generator=g) for _ in range(2))
        grad_out = torch.randn(2, hq, seq_len, 16, generator=g)
        ref = _attention_and_grads(causal_attention, q, k, v, grad_out)

        def local(t):
            return split_sequence(t, world, rank, dim=2)

        def attend(q, k, v):
            return cp_attention(q, k, v, group=group, cp=world, rank=rank)

        got = _attention_and_grads(attend, local(q), local(k), local(v), local(grad_out))
        # fp32 softmax-weighted sums of O(1) values over <= 40 keys, reduced in another order
        # (per-chunk SDPA, summed K/V gradients): differences are a few ulp, far below 1e-5.
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
            torch.testing.assert_close(a, local(b), rtol=1e-5, atol=1e-5, msg=name)

        # Document masking: the mask of this rank's queries over the whole sequence's keys.
        doc = _ragged_documents(2, seq_len, g)
        positions = split_sequence(torch.arange(seq_len), world, rank, dim=0)
        mask = document_causal_mask(doc, positions)

        full_masked = functools.partial(causal_attention, mask=document_causal_mask(doc))
        attend_masked = functools.partial(cp_attention, mask=mask, group=group, cp=world, rank=rank)
        ref = _attention_and_grads(full_masked, q, k, v, grad_out)
        got = _attention_and_grads(attend_masked, local(q), local(k), local(v), local(grad_out))
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
            torch.testing.assert_close(a, local(b), rtol=1e-5, atol=1e-5, msg=f"masked {name}")
    destroy()  # barrier first: gloo aborts a rank whose peer leaves mid-exchange


@pytest.mark.slow  # launches processes
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_matches_full_attention(cp):
    """Causal and document-masked (ragged documents across chunk and rank borders)."""
    mp.spawn(_worker, args=(cp, free_port()), nprocs=cp)


def test_cp_attention_never_gives_sdpa_a_mask_with_gqa(sdpa_calls):
    """The chunks' masked SDPA calls get K and V repeated to the query heads, never a mask with
    enable_gqa (on CUDA that pair leaves SDPA only its math kernel, which stores every score),
    and equal full causal attention. One rank in process (cp 1: an early and a late chunk)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(0)
        q, grad_out = (torch.randn(2, 8, 10, 16, generator=g) for _ in range(2))
        k, v = (torch.randn(2, 2, 10, 16, generator=g) for _ in range(2))
        ref = _attention_and_grads(causal_attention, q, k, v, grad_out)
        sdpa_calls.clear()

        def attend(q, k, v):
            return cp_attention(q, k, v, group=dist.group.WORLD, cp=1, rank=0)

        got = _attention_and_grads(attend, q, k, v, grad_out)
    finally:
        dist.destroy_process_group()
    assert len(sdpa_calls) == 2  # one per chunk
    for q_chunk, k_chunk, kwargs in sdpa_calls:
        assert kwargs["attn_mask"].dtype == torch.bool
        assert k_chunk.shape[1] == q_chunk.shape[1] and not kwargs.get("enable_gqa", False)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_split_sequence_balances_causal_work():
    """Rank r holds chunks r and 2cp-1-r: every rank's queries see the same number of keys."""
    cp, seq_len = 4, 16
    positions = torch.arange(seq_len)
    local = [split_sequence(positions, cp, r, dim=0) for r in range(cp)]
    assert sorted(torch.cat(local).tolist()) == list(range(seq_len))  # a partition
    assert local[1].tolist() == [2, 3, 12, 13]
    keys_seen = {int((p + 1).sum()) for p in local}  # causal: position p sees p + 1 keys
    assert len(keys_seen) == 1


def test_document_mask_of_some_queries_is_rows_of_the_whole_mask():
    """The mask of the queries at `positions` over every key is those rows of the whole
    sequence's mask: what a CP rank (its two chunks) and one process see agree."""
    doc = _ragged_documents(3, 24, torch.Generator().manual_seed(1))
    whole = document_causal_mask(doc)  # [b, 1, s, s]
    positions = split_sequence(torch.arange(24), 3, 1, dim=0)
    torch.testing.assert_close(document_causal_mask(doc, positions), whole[:, :, positions])
    assert not whole[0, 0].triu(1).any()  # causal
    assert (whole.sum(-1) >= 1).all()  # every query sees itself


def test_cp_attention_with_a_block_mask_matches_the_dense_mask():
    """The flex path (CUDA's for document masks) in one flex call over both chunks against the
    gathered keys, equal to the chunked dense-mask SDPA path; forward only: torch's flex
    attention has no CPU backward. One rank in process (cp 1: an early and a late chunk)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(2)
        q = torch.randn(2, 4, 256, 16, generator=g)
        k, v = (torch.randn(2, 2, 256, 16, generator=g) for _ in range(2))
        doc = _ragged_documents(2, 256, g)
        positions = split_sequence(torch.arange(256), 1, 0, dim=0)
        attend = functools.partial(cp_attention, group=dist.group.WORLD, cp=1, rank=0)
        with torch.no_grad():
            dense = attend(q, k, v, document_causal_mask(doc, positions))
            flex = attend(q, k, v, document_block_mask(doc, positions))
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
