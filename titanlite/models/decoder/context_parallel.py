"""Context parallelism as in the Llama 3 paper (section 3.3.2), on any device and kernel.

Each sequence is cut into 2 x CP equal chunks and CP rank r keeps chunks r and 2 x CP - 1 - r:
an early and a late one, so every rank has the same share of the causal attention work. Each
block's attention runs the local queries against K and V all-gathered over the CP group; with
GQA, K and V are a fraction of the activations, so the gather is cheap next to attention. Its
backward reduce-scatters (sums) the K/V gradients back to the ranks that computed K and V.

Everything else in a block is per token, so the rest of the model runs unchanged on the local
chunks. Document masks are the model's own, built from the whole sequence's document ids and the
local queries' positions. apply_cp (parallelize.py) installs the two pieces below from outside
the model; under pipeline parallelism, on every stage.
"""

import torch
from torch.nn.attention.flex_attention import BlockMask

from titanlite.models.decoder.model import causal_attention
from titanlite.models.kernels import sdpa
from titanlite.torch_compat import all_gather_autograd


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two of the 2 x CP sequence chunks that CP rank `rank` holds, in local order."""
    return rank, 2 * cp - 1 - rank


def split_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of `x` along `dim` (the sequence), concatenated."""
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(cp, rank)], dim=dim)


def gather_sequence(x: torch.Tensor, group, cp: int, dim: int) -> torch.Tensor:
    """Inverse of split_sequence over the CP group: every rank's chunks, in sequence order.

    The autograd all-gather's backward is a reduce-scatter (sum), which is the gradient of the
    gather: every rank's queries contribute to the gradient of the keys of earlier chunks.
    """
    gathered = all_gather_autograd(x.contiguous(), 0, group)
    halves = [part.chunk(2, dim=dim) for part in gathered.chunk(cp, dim=0)]  # per rank
    # Rank r holds chunks r and 2cp-1-r: first halves in rank order, then second halves reversed.
    ordered = [h[0] for h in halves] + [h[1] for h in reversed(halves)]
    return torch.cat(ordered, dim=dim)


def cp_attention(q, k, v, mask=None, *, group, cp: int, rank: int) -> torch.Tensor:
    """Attention of this rank's query chunks over the whole sequence's K and V: causal, or as
    the document `mask` of these queries over every key says (dense [b, 1, 2c, S] bool, or a
    flex BlockMask; the model builds it from the whole sequence's documents and the queries'
    positions, so documents that cross chunk and rank borders are seen whole).

    q [b, hq, 2c, hd], k and v [b, hkv, 2c, hd] (this rank's chunks) -> [b, hq, 2c, hd].
    """
    k = gather_sequence(k, group, cp, dim=2)  # [b, hkv, 2c, hd] -> [b, hkv, S, hd]
    v = gather_sequence(v, group, cp, dim=2)  # [b, hkv, 2c, hd] -> [b, hkv, S, hd]
    if isinstance(mask, BlockMask):
        # Flex skips the blocks the mask rules out, the keys after each chunk among them, so one
        # call serves both chunks.
        return causal_attention(q, k, v, mask)
    c = q.shape[2] // 2
    outs = []
    for i, (q_chunk, chunk) in enumerate(zip(q.split(c, dim=2), chunk_ids(cp, rank))):
        # Keys after the chunk are masked for all of its queries: they are not computed at all.
        end = (chunk + 1) * c
        if mask is None:
            # Query i of the chunk sits at position chunk * c + i and sees keys 0 .. chunk * c + i.
            q_pos = torch.arange(chunk * c, end, device=q.device)
            chunk_mask = torch.arange(end, device=q.device) <= q_pos[:, None]  # [c, end]
        else:
            chunk_mask = mask[:, :, i * c : (i + 1) * c, :end]  # [b, 1, c, end]
        # sdpa repeats K and V for the mask: on CUDA a fused kernel (memory-efficient, or
        # cuDNN) takes it, where GQA with a mask would leave SDPA only its math kernel, which
        # stores the scores [b, hq, c, end]. Flash takes no mask at all.
        outs.append(sdpa(q_chunk, k[:, :, :end], v[:, :, :end], chunk_mask))  # [b, hq, c, hd]
    return torch.cat(outs, dim=2)


def split_inputs(module, args, kwargs, *, cp: int, rank: int):
    """Forward pre-hook of the model, or of a pipeline stage: keep this rank's chunks of the
    tokens and labels, and pass their true positions for RoPE and the whole sequences' document
    ids for the mask (every key is attended to, so documents are taken before the split).

    A later pipeline stage is given hidden states the first stage has split already; its
    labels come whole from the schedule (and its documents, which its hidden states cannot
    give), and tell the sequence length.
    """
    x, rest = args[0], args[1:]
    labels = rest[0] if rest else kwargs.get("labels")
    if x.is_floating_point():
        seq_len = labels.shape[1]
    else:
        seq_len = x.shape[1]
        if kwargs.get("documents") is None:
            kwargs["documents"] = module.documents(x)
        x = split_sequence(x, cp, rank)
    rest = tuple(split_sequence(a, cp, rank) if torch.is_tensor(a) else a for a in rest)
    if torch.is_tensor(kwargs.get("labels")):
        kwargs["labels"] = split_sequence(kwargs["labels"], cp, rank)
    positions = torch.arange(seq_len, device=x.device)
    kwargs["positions"] = split_sequence(positions, cp, rank, dim=0)
    return (x, *rest), kwargs
