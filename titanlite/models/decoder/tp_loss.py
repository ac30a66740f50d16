"""The chunked loss on a vocab-sharded output layer (tensor parallelism), from outside the model.

`apply_tp` installs `tp_linear_cross_entropy_sum` as the model's chunked loss: each TP rank
computes its vocab slice of every chunk's logits and the per-token statistics are all-reduced over
the TP group, so no rank ever holds a full-vocab row.
"""

from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from titanlite.loss import VocabShard, linear_cross_entropy_sum


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    dist.all_reduce(t, op=op, group=group)
    return t


def tp_linear_cross_entropy_sum(
    h: torch.Tensor, weight: DTensor, labels: torch.Tensor, chunk_tokens: int, row_sources=None
):
    """linear_cross_entropy_sum with `weight` a Shard(0) DTensor over one TP mesh dim and `h`
    sequence-sharded or replicated; the result is the same plain fp32 scalar on every TP rank."""
    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(
            "loss.chunk_tokens > 0 needs the output weight sharded on vocab over one "
            f"tensor-parallel mesh dim, got placements {weight.placements} on {mesh}; "
            "set --loss.chunk_tokens 0"
        )
    if isinstance(h, DTensor):
        # Sequence-parallel hidden states: every rank needs all tokens against its vocab slice.
        h = h.redistribute(mesh, [Replicate()]).to_local()
    if isinstance(labels, DTensor):
        labels = labels.full_tensor()
    # Shard(0) splits like torch.chunk: ceil(V / n) rows per rank, the last ones may get fewer.
    vocab, n = weight.shape[0], mesh.size()
    vocab_start = min(mesh.get_local_rank() * -(-vocab // n), vocab)
    local = weight.to_local()
    assert local.shape[0] == min(-(-vocab // n), vocab - vocab_start), (local.shape, vocab)
    group = mesh.get_group()
    shard = VocabShard(
        vocab_start,
        all_max=partial(_all_reduce, op=dist.ReduceOp.MAX, group=group),
        all_sum=partial(_all_reduce, op=dist.ReduceOp.SUM, group=group),
    )
    return linear_cross_entropy_sum(h, local, labels, chunk_tokens, shard, row_sources)
