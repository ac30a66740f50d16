"""Llama 3 in plain PyTorch. Knows nothing of ranks, meshes or configs.

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
from titanlite.models.llama.args import (
    ROPE_HIGH_FREQ_FACTOR,
    ROPE_LOW_FREQ_FACTOR,
    ROPE_OLD_CONTEXT_LEN,
    ROPE_SCALE_FACTOR,
    ModelArgs,
)
from titanlite.models.tiled_init import ParamInit, fill_


def rope_frequencies(head_dim: int, theta: float, scaled: bool) -> torch.Tensor:
    """Per-pair rotation frequencies [head_dim // 2] (fp32)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if not scaled:
        return freqs
    # Long wavelengths (> old context / low factor) are slowed by the scale factor, short ones
    # (< old context / high factor) kept, and the band in between interpolated smoothly.
    wavelen = 2 * math.pi / freqs
    low_freq_wavelen = ROPE_OLD_CONTEXT_LEN / ROPE_LOW_FREQ_FACTOR
    high_freq_wavelen = ROPE_OLD_CONTEXT_LEN / ROPE_HIGH_FREQ_FACTOR
    smooth = (ROPE_OLD_CONTEXT_LEN / wavelen - ROPE_LOW_FREQ_FACTOR) / (
        ROPE_HIGH_FREQ_FACTOR - ROPE_LOW_FREQ_FACTOR
    )
    mid = (1 - smooth) * freqs / ROPE_SCALE_FACTOR + smooth * freqs
    scaled_freqs = torch.where(wavelen > low_freq_wavelen, freqs / ROPE_SCALE_FACTOR, mid)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled_freqs)


def precompute_rope_cache(args: ModelArgs) -> torch.Tensor:
    """cat(cos, sin) of position * frequency: [max_seq_len, head_dim] fp32.

    Real-valued rather than complex because complex tensors are awkward under DTensor and compile.
    """
    freqs = rope_frequencies(args.head_dim, args.rope_theta, args.use_scaled_rope)
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


def sdpa(q, k, v, mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA of q [b, hq, sq, hd] over k, v [b, hkv, skv, hd] -> [b, hq, sq, hd]: causal (sq ==
    skv), or where the bool `mask` [.., sq, skv] is True.

    GQA: query head j attends with kv head j // n_rep (Meta's repeat_kv order; SDPA's enable_gqa
    and flex's too). Without a mask, on a GPU, SDPA reads the kv heads in place (enable_gqa: the
    flash and cuDNN kernels do GQA natively, with no n_rep-fold copy of K and V to write and keep
    for backward). With a mask K and V are repeated to hq heads first: no fused CUDA kernel of
    torch 2.11 takes a mask together with GQA when cuDNN's is not chosen (flash takes no mask,
    memory-efficient no GQA), and SDPA's math fallback materializes every score [b, hq, sq, skv].
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


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[b, hkv, s, hd] -> [b, hkv * n_rep, s, hd], each kv head repeated for its query heads."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def additive_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = attend) as SDPA applies it: 0 where True, -inf elsewhere."""
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(~mask, -math.inf)


def fp32_backward(q: torch.Tensor) -> bool:
    """Whether attention's backward runs in fp32 (CpuFlashFp32Backward): for bf16 on CPU at
    head_dim <= 64. Up to there torch's bf16 CPU flash backward is the slower kernel or no
    faster (an AVX-512 BF16 machine, 8 x 256 tokens at width 256, with the casts, 1 / 2 threads:
    50 / 27 against 27 / 15 ms at head_dim 16, 29 / 15 against 21 / 13 at 32, 20.4 / 10.1
    against 19.3 / 9.9 at 64; 11-18% faster at 128: scripts/bench_cpu_attention.py), and at every
    head_dim it is the less exact one (gradients 3.5e-3 off an fp64 backward, relative, against
    1.9e-3). At 64 the casts take what the kernel saves (a width-768 model's step: the same time
    either way), so there the reason is the exact gradients."""
    return q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.shape[-1] <= 64


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
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = flash(q, k, v, 0.0, bias is None, attn_mask=bias)
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.n_rep = n_rep
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, bias, out, lse = ctx.saved_tensors
        flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        fp32 = [t.float() for t in (grad_out, q, k, v, out)]
        bias = None if bias is None else bias.float()
        dq, dk, dv = flash_backward(*fp32, lse, 0.0, bias is None, attn_mask=bias)
        if ctx.n_rep > 1:  # [b, hkv * n_rep, s, hd] -> [b, hkv, s, hd]: query heads adjacent
            dk, dv = (g.unflatten(1, (-1, ctx.n_rep)).sum(2) for g in (dk, dv))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def native_gqa(device: torch.device) -> bool:
    """Whether unmasked SDPA takes K and V with their kv heads (enable_gqa) on `device`.

    Not on CPU: torch's CPU flash kernel is faster so (a debug-model step with 4 kv heads, batch
    8 x 256, one thread: 841 -> 789 ms fp32, 718 -> 683 ms bf16 of CPU time), but its bf16
    backward sums the query heads' K and V gradients less exactly (32 heads over 8: dk 7.2e-3
    off fp64, relative, against 4.8e-3 repeated), enough to push bf16 layouts apart (TP 4 against
    one process: 1.2e-4 on the second loss, against 2e-5). CUDA's flash kernel, by its source,
    writes per-head gradients and sums them, as the repeated form's backward does.
    """
    return device.type != "cpu"


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
    def __init__(self, args: ModelArgs):
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

    def __init__(self, args: ModelArgs):
        super().__init__()
        hidden = args.ffn_hidden_dim
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm as the model builds it (over the last dim, with a weight), with a backward
    of its own on CPU.

    On a GPU torch runs one fused kernel each way. On CPU it runs the composite (upcast, pow,
    mean, rsqrt, two products), and autograd differentiates each op: expanded gradients, mixed
    bf16 x fp32 products, and an fp32 copy of the input and of x * rstd kept per norm. Here the
    forward is the same ops (bitwise the same output) but keeps only the input and rstd, and the
    backward is the closed form in fp32, rounded once: on the debug model's [8, 256, 256] norms,
    one thread, fwd + bwd 2.3 -> 1.35 ms in bf16, 1.9 -> 1.1 ms in fp32, and 6 fewer bytes kept
    per element in bf16. Compiled, inductor fuses the composite: it stays.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or torch.compiler.is_compiling():
            return super().forward(x)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return _CpuRMSNorm.apply(x, self.weight, eps)


class _CpuRMSNorm(torch.autograd.Function):
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


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
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
    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.vocab_size < 1:
            raise ValueError(
                f"ModelArgs.vocab_size must be set (got {args.vocab_size}); "
                "use get_model_args(flavor, pad_vocab(tokenizer.n_words), ...)"
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
    ) -> torch.Tensor:
        """tokens [b, s] -> logits [b, s, vocab], or with labels the fp32 summed cross-entropy.
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
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)  # [b, s, dim]
        for layer in self.layers.values():
            h = layer(h, rope_cache, mask)
        if self.output is None:
            return h
        h = self.norm(h)
        if labels is None:
            return self.output(h)
        if chunk_tokens > 0:
            return self.chunked_loss(h, self.output.weight, labels, chunk_tokens)
        return self.plain_loss(self.output(h), labels)
