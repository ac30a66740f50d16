"""The Llama-style decoder in plain PyTorch (RMSNorm, RoPE, GQA, SwiGLU), which the Llama 3 and
Qwen3 families build: a family's args choose its shapes and two options, QK-norm (`qk_norm`) and
the output tied to the embedding (`tie_embeddings`). Knows nothing of ranks, meshes or configs.

Attribute names follow Meta's checkpoints so conversion is a key map. Parallelism is applied from
the outside (parallelize.py); for that the attention derives its local head counts from shapes,
the chunked loss is an attribute that tensor parallelism replaces with its vocab-sharded version,
the attention kernel one that context parallelism replaces, and forward takes the tokens' true
positions when it is given only a part of each sequence.
"""

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from titanlite.loss import cross_entropy_sum, linear_cross_entropy_sum
from titanlite.models.kernels import rms_norm, sdpa
from titanlite.models.tiled_init import ParamInit, fill_


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Per-pair rotation frequencies [head_dim // 2] (fp32); `scaling`: Llama 3.1's frequency
    scaling as HF's config.json names it (the args' rope_scaling), or None."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return freqs
    assert scaling["rope_type"] == "llama3", scaling
    factor, old_context = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    # Long wavelengths (> old context / low factor) are slowed by the scale factor, short ones
    # (< old context / high factor) kept, and the band in between interpolated smoothly.
    wavelen = 2 * math.pi / freqs
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    smooth = (old_context / wavelen - low) / (high - low)
    mid = (1 - smooth) * freqs / factor + smooth * freqs
    scaled_freqs = torch.where(wavelen > low_freq_wavelen, freqs / factor, mid)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled_freqs)


def precompute_rope_cache(args) -> torch.Tensor:
    """cat(cos, sin) of position * frequency: [max_seq_len, head_dim] fp32.

    Real-valued rather than complex because complex tensors are awkward under DTensor and compile.
    """
    freqs = rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), freqs)  # [S, hd/2]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rotary_emb(x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of x [b, s, h, hd] by rope_cache [s, hd].

    Adjacent (interleaved) pairs, as Meta's complex-number reference, so Meta weights load as is.
    Eager, each pair is multiplied as a complex number: one kernel each way where the arithmetic
    on real and imaginary parts launches ten, whose host time an eager GPU step waits for.
    Compiled, that arithmetic is spelled out: inductor fuses it, but not complex multiplication.
    """
    cos, sin = rope_cache.chunk(2, dim=-1)  # each [s, hd/2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # [1, s, 1, hd/2]
    # fp32 rotation (as the reference) so bf16 activations don't lose the position signal.
    pairs = x.float().unflatten(-1, (-1, 2))  # [b, s, h, hd] -> [b, s, h, hd/2, 2]
    if torch.compiler.is_compiling():
        real, imag = pairs.unbind(-1)  # each [b, s, h, hd/2]
        rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    else:
        rotated = torch.view_as_real(torch.view_as_complex(pairs) * torch.complex(cos, sin))
    return rotated.flatten(-2).type_as(x)  # [b, s, h, hd/2, 2] -> [b, s, h, hd]


def causal_attention(q, k, v, mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
    """Causal attention of q [b, hq, s, hd] over k, v [b, hkv, s, hd] -> [b, hq, s, hd]; with
    `mask` (a dense [b, 1, s, s] bool mask, True = attend, causal already; or a flex BlockMask)
    instead of the plain causal one."""
    if isinstance(mask, BlockMask):
        return _flex_attention(q, k, v, mask)
    return sdpa(q, k, v, mask)


@functools.cache
def _compiled(fn):
    """fn under torch.compile, made on first use: torch.compile at import would load inductor
    into every process that imports the model (a second or more of start-up for each rank, GPU
    job or not)."""
    return torch.compile(fn)


def _flex(fn, device: torch.device):
    """flex_attention or create_block_mask as run on `device`: compiled, except on CPU.

    Eager flex_attention is a dense reference that materializes every score, and eager
    create_block_mask evaluates the mask on the whole [b, s, s] grid in memory; compiled, they
    are the block-sparse kernel that skips the blocks across documents and a fused per-block
    mask builder (torchtitan compiles both). On CPU flex attention only runs without gradients
    (torch has no CPU backward for it): there the exact eager reference serves evaluation and
    spares a compile. Inside compiled blocks (--compile.enable) dynamo traces fn into the block's
    own graph, so fn is returned as is: tracing into the cached torch.compile wrapper instead
    makes dynamo warn that it bypasses the cache, on every compiled run.
    """
    if device.type == "cpu" or torch.compiler.is_compiling():
        return fn
    return _compiled(fn)


def _flex_attention(q, k, v, block_mask: BlockMask) -> torch.Tensor:
    flex = _flex(flex_attention, q.device)
    return flex(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


def document_ids(tokens: torch.Tensor, bos_id: int, eos_id: int) -> torch.Tensor:
    """[b, s] tokens of packed documents -> [b, s] the index of each token's document.

    A document starts at a bos right after an eos (not at every bos: some tokenizers use one
    token for both, and then only the pair marks a boundary).
    """
    starts = (tokens[:, 1:] == bos_id) & (tokens[:, :-1] == eos_id)  # [b, s-1]
    return F.pad(starts.cumsum(dim=1), (1, 0))


def document_causal_mask(doc: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """[b, S] document ids -> [b, 1, sq, S] dense mask (SDPA): the queries at `positions` [sq]
    (default: every position) see the earlier keys of their own document."""
    s = doc.shape[1]
    keys = torch.arange(s, device=doc.device)
    queries = keys if positions is None else positions
    causal = keys[None, :] <= queries[:, None]  # [sq, S]
    same = doc[:, queries, None] == doc[:, None, :]  # [b, sq, S]
    return same.logical_and(causal).unsqueeze(1)


def document_block_mask(doc: torch.Tensor, positions: torch.Tensor | None = None) -> BlockMask:
    """[b, S] document ids -> the same mask for flex attention, stored per 128 x 128 block, so
    attention skips the blocks where no query may see a key (most of them, with many short
    documents) instead of reading an sq x S mask."""
    b, s = doc.shape

    def same_document_causal(b, h, q_idx, kv_idx):
        q_pos = q_idx if positions is None else positions[q_idx]
        return (q_pos >= kv_idx) & (doc[b, q_pos] == doc[b, kv_idx])

    # Built once per forward, for all layers. Compiled, later steps reuse the graph: the mask
    # function is a new closure each step, but dynamo guards on its code and treats the document
    # ids it reads as a graph input.
    create = _flex(create_block_mask, doc.device)
    q_len = s if positions is None else len(positions)
    return create(same_document_causal, b, None, q_len, s, device=doc.device)


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.head_dim = args.head_dim
        # (q, k, v, mask) -> attention output; context parallelism swaps in one over gathered
        # k and v.
        self.attend = causal_attention
        kv_dim = args.num_kv_heads * args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, kv_dim, bias=False)
        self.wv = nn.Linear(args.dim, kv_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # QK-norm (Qwen3): each head's q and k RMS-normalized before RoPE, one weight per norm
        # shared by the heads.
        self.q_norm = RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, mask=None) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)  # [b, s, dim] -> [b, s, hq, hd]
        k = self.wk(x).view(b, s, -1, self.head_dim)  # [b, s, kv_dim] -> [b, s, hkv, hd]
        v = self.wv(x).view(b, s, -1, self.head_dim)  # [b, s, kv_dim] -> [b, s, hkv, hd]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_emb(q, rope_cache), apply_rotary_emb(k, rope_cache)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, s, h, hd] -> [b, h, s, hd]
        out = self.attend(q, k, v, mask)  # [b, hq, s, hd]
        out = out.transpose(1, 2).reshape(b, s, -1)  # [b, hq, s, hd] -> [b, s, hq * hd]
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, args):
        super().__init__()
        hidden = args.ffn_hidden_dim
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm as the model builds it (over the last dim, with a weight), run by the kernel
    its device takes (titanlite.models.kernels.rms_norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, mask=None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class TiedOutput(nn.Module):
    """The output projection by the embedding's weight, which it reads but does not hold: the
    model has one [vocab, dim] parameter, so moving it (to_empty, which gives each module its own
    copy of a shared parameter), FSDP and checkpoints see it once."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self._embedding = [embedding]  # in a list: not registered as a submodule

    @property
    def weight(self) -> torch.Tensor:
        return self._embedding[0].weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight)


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        if args.vocab_size < 1:
            raise ValueError(
                f"the model args' vocab_size must be set (got {args.vocab_size}); use the "
                "family's model_args(flavor, pad_vocab(tokenizer.n_words), ...)"
            )
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        if args.tie_embeddings:
            self.output = TiedOutput(self.tok_embeddings)
        else:
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Non-persistent: derived from args, so checkpoints stay Meta-compatible.
        self.register_buffer("rope_cache", precompute_rope_cache(args), persistent=False)
        # (h, output weight, labels, chunk_tokens) -> summed CE; apply_tp swaps in a sharded one.
        self.chunked_loss = linear_cross_entropy_sum
        # (logits, labels) -> summed CE; apply_compile swaps in a compiled one.
        self.plain_loss = cross_entropy_sum

    def param_init(self, name: str) -> ParamInit:
        """The distribution of parameter `name` (a state-dict key, any layout's)."""
        if name.endswith("norm.weight"):
            return ParamInit(constant=1.0)
        if name == "tok_embeddings.weight" and not self.args.tie_embeddings:
            return ParamInit(std=1.0)
        if name in ("output.weight", "tok_embeddings.weight"):  # (tied: the output's scale)
            # 1/sqrt(dim) keeps the initial logits O(1): the first loss is close to ln(vocab).
            std = self.args.dim**-0.5
            return ParamInit(std=std, bound=3 * std)
        std = 0.02
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            # Depth scaling keeps each residual branch's contribution from growing with depth.
            std /= math.sqrt(2 * (int(name.split(".")[1]) + 1))
        # Untruncated: the usual cut at +-2 is 100 std here, never reached, and plain normal
        # draws 4x faster than truncated normal (most of init time at 405B).
        return ParamInit(std=std)

    def init_buffers(self, device: torch.device | str | None = None):
        """Compute rope_cache (not in checkpoints; to_empty leaves it garbage) on `device`
        (default: where it is now), e.g. "cuda" when the parameters were built elsewhere."""
        with torch.device(device or self.rope_cache.device):
            self.rope_cache = precompute_rope_cache(self.args)

    def init_weights(self, seed: int = 0, buffer_device: torch.device | str | None = None):
        """Draw every parameter from `seed` (tiled: a sharded copy of this model draws the same
        values for its shards, see tiled_init) and compute the buffers."""
        self.init_buffers(buffer_device)
        for name, param in self.named_parameters():
            fill_(param, self.param_init(name), seed=seed, key=name, global_shape=param.shape)

    def documents(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """[b, s] token ids -> each token's document index, or None without document masking."""
        if not self.args.document_masking:
            return None
        if tokens.is_floating_point():
            raise ValueError(
                "document masking needs the token ids: a part of the model given hidden states "
                "(a later pipeline stage) must be passed documents="
            )
        return document_ids(tokens, self.args.bos_id, self.args.eos_id)

    def attention_mask(self, documents, positions=None) -> torch.Tensor | BlockMask | None:
        """None (plain causal) or the document mask of the queries at `positions` (default:
        every position) over the whole sequence's keys, in the attention backend's form."""
        if documents is None:
            return None
        if self.args.attention_backend == "flex":
            return document_block_mask(documents, positions)
        return document_causal_mask(documents, positions)

    def num_params(self, exclude_embedding: bool = True) -> int:
        """Parameter count (global under FSDP/TP: DTensor.numel() is the full size)."""
        n = sum(p.numel() for p in self.parameters())
        # A tied embedding is the output projection too, whose matmul counts.
        if exclude_embedding and self.tok_embeddings is not None and not self.args.tie_embeddings:
            n -= self.tok_embeddings.weight.numel()
        return n

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        chunk_tokens: int = 0,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        row_sources: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [b, s] -> logits [b, s, vocab], or with labels the fp32 summed cross-entropy
        (with row_sources, the rows' one-hot sources [b, n] of a mixture: that sum and the
        per-source sums [n], titanlite/loss.py).
        (A part without tok_embeddings takes hidden states [b, s, dim] as `tokens`; one without
        output returns its hidden states.)

        positions [s]: each token's position in its sequence (default 0..s-1), for callers that
        pass a part of each sequence. documents [b, S]: the document index of every token of the
        whole sequences (document masking; default: from `tokens`), for callers whose `tokens`
        are not those sequences' ids: a part of each, or a later pipeline stage's hidden states,
        whose attention still needs the documents of every key. The loss is computed here, not
        by the caller, so the output weight is read inside this module's forward (unsharded by
        FSDP at that point).
        """
        seq_len = tokens.shape[1]
        if seq_len > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_seq_len {self.args.max_seq_len}; "
                "build the model with a larger max_seq_len"
            )
        # [max_seq_len, hd] -> [s, hd]
        rope_cache = self.rope_cache[:seq_len] if positions is None else self.rope_cache[positions]
        if documents is None:
            documents = self.documents(tokens)
        mask = self.attention_mask(documents, positions)
        # A pipeline stage cut from this model may lack the embedding (it is given the previous
        # stage's hidden states) or the head (it returns its hidden states).
        # (The last stage of a tied output keeps the embedding for its weight only.)
        h = tokens if tokens.is_floating_point() else self.tok_embeddings(tokens)  # [b, s, dim]
        for layer in self.layers.values():
            h = layer(h, rope_cache, mask)
        if self.output is None:
            return h
        h = self.norm(h)
        if labels is None:
            return self.output(h)
        by = {} if row_sources is None else {"row_sources": row_sources}
        if chunk_tokens > 0:
            return self.chunked_loss(h, self.output.weight, labels, chunk_tokens, **by)
        return self.plain_loss(self.output(h), labels, **by)
