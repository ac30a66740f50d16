import functools
import math

import pytest
import torch
import torch.nn.functional as F

from titanlite.config import ConfigError
from titanlite.models import kernels
from titanlite.models.decoder import model as model_module
from titanlite.models.decoder.model import (
    Transformer,
    apply_rotary_emb,
    precompute_rope_cache,
    rope_frequencies,
    sdpa,
)
from titanlite.models.decoder.parallelize import apply_compile
from titanlite.models.llama.args import (
    LLAMA3_FLAVORS,
    ROPE_OLD_CONTEXT_LEN,
    ROPE_SCALE_FACTOR,
    ModelArgs,
    get_model_args,
    pad_vocab,
)

VOCAB = 512


def build(seed=0, **overrides):
    args = get_model_args("debugmodel", VOCAB, max_seq_len=64, use_scaled_rope=False)
    if overrides:
        args = ModelArgs(**{**args.__dict__, **overrides})
    model = Transformer(args)
    model.init_weights(seed)
    return model


def tokens(b=2, s=16, seed=1):
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


def test_debug_flavor_shapes():
    args = LLAMA3_FLAVORS["debugmodel"]
    assert (args.dim, args.n_layers, args.n_heads, args.num_kv_heads) == (256, 6, 16, 16)
    assert args.ffn_hidden_dim == 768
    assert LLAMA3_FLAVORS["8B"].ffn_hidden_dim == 14336
    assert LLAMA3_FLAVORS["70B"].ffn_hidden_dim == 28672
    assert LLAMA3_FLAVORS["405B"].ffn_hidden_dim == 53248
    assert LLAMA3_FLAVORS["1B"].ffn_hidden_dim == 8192


@pytest.mark.parametrize("masked,native", [(False, True), (True, True), (False, False)])
def test_sdpa_gqa_reads_kv_heads_in_place_only_unmasked_off_cpu(
    masked, native, sdpa_calls, monkeypatch
):
    """Where native GQA is on (a GPU; forced here on CPU) and there is no mask: SDPA's enable_gqa
    over the kv heads as they are. With a mask: K and V repeated, never a mask with enable_gqa
    (on CUDA that pair leaves SDPA only its math kernel); on CPU: repeated. Every form equals the
    repeated-K/V one (Meta's repeat_kv order: query head j uses kv head j // 4), outputs and
    gradients, to fp32 rounding."""
    assert not kernels.native_gqa(torch.device("cpu"))
    monkeypatch.setattr(kernels, "native_gqa", lambda device: native)
    g = torch.Generator().manual_seed(0)
    q, grad_out = (torch.randn(2, 8, 12, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 2, 12, 16, generator=g) for _ in range(2))
    # Causal within two documents of 5 and 7 tokens, or plain causal.
    mask = None
    if masked:
        doc = torch.tensor([[0] * 5 + [1] * 7]).repeat(2, 1)
        mask = (doc[:, :, None] == doc[:, None, :]).tril().unsqueeze(1)  # [2, 1, 12, 12]
    results = []
    for attend in (sdpa, _repeated_kv_sdpa):
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*qkv, mask)
        out.backward(grad_out)
        results.append([out.detach(), *(t.grad for t in qkv)])
    (q_new, k_new, kwargs), _ = sdpa_calls
    in_place = native and not masked
    assert k_new.shape[1] == (2 if in_place else 8)
    assert kwargs.get("enable_gqa", False) == in_place
    for new, old in zip(*results, strict=True):
        torch.testing.assert_close(new, old)


def _repeated_kv_sdpa(q, k, v, mask):
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)


@pytest.mark.parametrize(
    ("device", "dtype", "head_dim", "fp32"),
    [
        ("cpu", torch.bfloat16, 16, True),
        ("cpu", torch.bfloat16, 64, True),  # no slower than bf16's and more exact
        ("cpu", torch.bfloat16, 128, False),  # bf16's backward is the faster kernel there
        ("cpu", torch.float32, 16, False),
        ("meta", torch.bfloat16, 16, False),  # a GPU's kernels are not CPU flash's
    ],
)
def test_attention_backward_runs_in_fp32_for_bf16_on_cpu_up_to_head_dim_64(
    device, dtype, head_dim, fp32
):
    q = torch.empty(2, 4, 8, head_dim, dtype=dtype, device=device)
    assert kernels.fp32_backward(q) == fp32


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("n_kv_heads", [8, 2])
def test_cpu_bf16_attention_forward_is_sdpa_and_backward_is_fp32(masked, n_kv_heads):
    """bf16 on CPU at head_dim 16: the output is SDPA's bitwise. Each gradient, computed in fp32
    from the bf16 inputs and the bf16 output, then rounded once, is off the fp64 backward by its
    own final rounding plus what the output's rounding carries into dq and dk: within 1.5x the
    error of rounding the exact gradient to bf16 (whole tensors, relative; fp32's own sums, in
    whatever order a CPU's kernel takes them, are 2^16 times finer). SDPA's bf16 kernel, which
    rounds inside, misses that bound (1.5x-2.1x; worst for K and V summed over query heads)."""
    g = torch.Generator().manual_seed(0)
    q, grad_out = (torch.randn(2, 8, 64, 16, generator=g, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, n_kv_heads, 64, 16, generator=g, dtype=torch.bfloat16) for _ in range(2))
    mask = None
    if masked:
        doc = (torch.arange(64) >= 20).long().repeat(2, 1)  # documents of 20 and 44 tokens
        mask = model_module.document_causal_mask(doc)
    assert kernels.fp32_backward(q)
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sdpa(*qkv, mask)
    out.backward(grad_out)
    assert torch.equal(out, _repeated_kv_sdpa(q, k, v, mask))
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    _repeated_kv_sdpa(*exact, mask).backward(grad_out.double())
    for t, ref in zip(qkv, exact, strict=True):
        assert t.grad.dtype == torch.bfloat16
        one_rounding = (ref.grad.to(torch.bfloat16).double() - ref.grad).norm()
        assert (t.grad.double() - ref.grad).norm() < 1.5 * one_rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_rmsnorm_forward_is_torchs_and_backward_is_exact(dtype):
    """On CPU model.RMSNorm's output is nn.RMSNorm's bitwise; its gradients, computed in fp32 and
    rounded once, are off the fp64 backward by no more than torch's own (bf16: within 1.5x the
    error of rounding the exact gradient once); it keeps the input and an fp32 rstd per row."""
    g = torch.Generator().manual_seed(0)
    x, grad_out = (3 * torch.randn(4, 16, 64, generator=g).to(dtype) for _ in range(2))
    ours, torchs = model_module.RMSNorm(64, eps=1e-5), torch.nn.RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        torchs.weight.copy_(0.5 + torch.rand(64, generator=g))
        ours.weight.copy_(torchs.weight)
    ours, torchs = ours.to(dtype), torchs.to(dtype)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = ours(x.clone().requires_grad_())
    assert [(t.shape, t.dtype) for t in saved] == [
        (x.shape, dtype),
        ((64,), dtype),
        ((4, 16, 1), torch.float32),
    ]
    assert torch.equal(out, torchs(x))
    exact_x, exact_w = x.double().requires_grad_(), torchs.weight.double().detach().requires_grad_()
    rstd = torch.rsqrt(exact_x.pow(2).mean(-1, keepdim=True) + 1e-5)
    (exact_x * rstd * exact_w).backward(grad_out.double())

    def grads(module):
        x_ = x.clone().requires_grad_()
        module(x_).backward(grad_out)
        return x_.grad, module.weight.grad

    def error(t, ref):
        return (t.double() - ref).norm()

    for t, t_torch, ref in zip(grads(ours), grads(torchs), (exact_x.grad, exact_w.grad)):
        assert t.dtype == dtype
        if dtype == torch.float32:
            assert error(t, ref) <= 1.5 * error(t_torch, ref)
        else:
            assert error(t, ref) < 1.5 * error(ref.to(dtype), ref)


def test_logits_shape_and_dtype():
    model = build()
    logits = model(tokens())
    assert logits.shape == (2, 16, VOCAB)
    assert logits.dtype == model.output.weight.dtype


@pytest.mark.parametrize("chunk_tokens", [0, 5])
def test_loss_equals_cross_entropy_sum(chunk_tokens):
    model = build()
    x = tokens()
    labels = tokens(seed=2)
    labels[0, :3] = -100
    labels[1, -1] = -100
    with torch.no_grad():
        expected = F.cross_entropy(
            model(x).flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        loss = model(x, labels, chunk_tokens=chunk_tokens)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-4)


def test_loss_backward_reaches_all_params():
    model = build()
    model(tokens(), tokens(seed=2)).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("n_kv_heads", [None, 4])
def test_causal(n_kv_heads):
    model = build(n_kv_heads=n_kv_heads)
    x = tokens(b=1, s=12)
    t = 7
    changed = x.clone()
    changed[0, t] = (x[0, t] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(x), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=0)
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_gqa_shapes_and_matches_repeated_kv_mha():
    """GQA with kv heads repeated into a plain MHA model gives the same logits."""
    gqa = build(n_kv_heads=4)
    assert gqa.layers["0"].attention.wk.weight.shape == (4 * 16, 256)
    mha = build(n_kv_heads=None)
    state = gqa.state_dict()
    hd, n_rep = 16, 4
    for i in range(gqa.args.n_layers):
        for name in ("wk", "wv"):
            key = f"layers.{i}.attention.{name}.weight"
            w = state[key].view(4, hd, 256)  # [hkv * hd, dim] -> [hkv, hd, dim]
            state[key] = w.repeat_interleave(n_rep, dim=0).reshape(16 * hd, 256)  # -> [hq*hd, dim]
    mha.load_state_dict(state)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(gqa(x), mha(x), rtol=1e-5, atol=1e-5)


def test_scaled_rope_changes_only_low_frequencies():
    plain = rope_frequencies(128, 500000.0, None)
    scaled_args = get_model_args("debugmodel", VOCAB, max_seq_len=32, use_scaled_rope=True)
    scaled = rope_frequencies(128, 500000.0, scaled_args.rope_scaling)
    wavelen = 2 * math.pi / plain
    high = wavelen < ROPE_OLD_CONTEXT_LEN / 4  # short wavelengths: untouched
    low = wavelen > ROPE_OLD_CONTEXT_LEN  # long wavelengths: divided by the scale factor
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()
    torch.testing.assert_close(scaled[high], plain[high], rtol=0, atol=0)
    torch.testing.assert_close(scaled[low], plain[low] / ROPE_SCALE_FACTOR)
    # The band in between is interpolated: strictly between the two.
    assert (scaled[mid] < plain[mid]).all() and (scaled[mid] > plain[mid] / ROPE_SCALE_FACTOR).all()
    # Reference formula for one mid frequency (Meta's apply_scaling).
    f = plain[mid][0]
    smooth = (ROPE_OLD_CONTEXT_LEN / (2 * math.pi / f) - 1) / (4 - 1)
    torch.testing.assert_close(scaled[mid][0], (1 - smooth) * f / 8 + smooth * f)


def test_rope_cache_values():
    args = get_model_args("debugmodel", VOCAB, max_seq_len=32)
    cache = precompute_rope_cache(args)
    assert cache.shape == (32, args.head_dim)
    freqs = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
    angle = 5 * freqs
    torch.testing.assert_close(cache[5], torch.cat([angle.cos(), angle.sin()]))


def test_rotary_matches_meta_complex_reference():
    """Same rotation as Meta's view_as_complex(x pairs) * polar(1, angle), so Meta weights load."""
    args = get_model_args("debugmodel", VOCAB, max_seq_len=32, use_scaled_rope=True)
    x = torch.randn(2, 10, 3, args.head_dim)
    freqs = rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
    angles = torch.outer(torch.arange(10).float(), freqs)  # [s, hd/2]
    freqs_cis = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]  # [1, s, 1, hd/2]
    x_c = torch.view_as_complex(x.unflatten(-1, (-1, 2)))  # [b, s, h, hd] -> [b, s, h, hd/2]
    expected = torch.view_as_real(x_c * freqs_cis).flatten(-2)  # -> [b, s, h, hd]
    got = apply_rotary_emb(x, precompute_rope_cache(args)[:10])
    torch.testing.assert_close(got, expected)


def test_meta_init_equals_direct_init():
    args = get_model_args("debugmodel", VOCAB, max_seq_len=64)
    direct = Transformer(args)
    direct.init_weights(123)

    with torch.device("meta"):
        lazy = Transformer(args)
    assert lazy.rope_cache.is_meta
    lazy.to_empty(device="cpu")
    lazy.init_weights(123)

    direct_sd, lazy_sd = direct.state_dict(), lazy.state_dict()
    assert direct_sd.keys() == lazy_sd.keys()
    assert "rope_cache" not in lazy_sd  # non-persistent: checkpoints hold only Meta's keys
    for k in direct_sd:
        assert torch.equal(direct_sd[k], lazy_sd[k]), k
    assert torch.equal(lazy.rope_cache, precompute_rope_cache(args))
    assert torch.equal(lazy.rope_cache, direct.rope_cache)


def test_init_scheme():
    model = build()
    assert torch.equal(model.norm.weight, torch.ones(256))
    assert model.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.05)
    out_std = 256**-0.5
    assert model.output.weight.abs().max().item() <= 3 * out_std
    last = model.layers["5"]
    assert last.attention.wo.weight.std().item() == pytest.approx(0.02 / math.sqrt(12), rel=0.1)
    assert last.feed_forward.w1.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_unknown_flavor_lists_available():
    with pytest.raises(ValueError, match="debugmodel.*8B"):
        get_model_args("9B", VOCAB, 64)


def test_args_validation():
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelArgs(dim=256, n_layers=1, n_heads=16, n_kv_heads=5)
    with pytest.raises(ValueError, match="vocab_size"):
        Transformer(LLAMA3_FLAVORS["debugmodel"])
    with pytest.raises(ValueError, match="max_seq_len"):
        build()(tokens(s=65))


def test_pad_vocab():
    assert pad_vocab(100277) == 100352
    assert pad_vocab(128256) == 128256
    assert pad_vocab(5, 8) == 8


def test_scaled_rope_flag():
    assert not get_model_args("8B", 128256, 8192).use_scaled_rope
    assert get_model_args("8B", 128256, 8192, use_scaled_rope=True).use_scaled_rope
    assert get_model_args("1B", 128256, 8192).use_scaled_rope


def expected_params(args: ModelArgs) -> int:
    """From the dims alone: embedding + output + layers (attention, FFN, 2 norms) + final norm."""
    hd, kv = args.head_dim, args.num_kv_heads
    attn = args.dim * args.n_heads * hd * 2 + args.dim * kv * hd * 2
    ffn = 3 * args.dim * args.ffn_hidden_dim
    per_layer = attn + ffn + 2 * args.dim
    return 2 * args.vocab_size * args.dim + args.n_layers * per_layer + args.dim


@pytest.mark.parametrize(
    "flavor,published", [("1B", None), ("3B", None), ("8B", 8.03e9), ("70B", 70.6e9)]
)
def test_param_counts(flavor, published):
    args = get_model_args(flavor, 128256, 2048)
    with torch.device("meta"):
        model = Transformer(args)
    total = model.num_params(exclude_embedding=False)
    assert total == expected_params(args)
    assert model.num_params() == total - 128256 * args.dim
    if published is not None:
        assert total == pytest.approx(published, rel=0.005)


BOS, EOS = 500, 501


@pytest.mark.parametrize("bos, eos", [(BOS, EOS), (EOS, EOS)], ids=["llama3", "one_token"])
def test_document_mask_starts_a_document_at_bos_after_eos(bos, eos):
    from titanlite.models.decoder.model import document_causal_mask, document_ids

    # The tail of a document, a whole one, the head of a third (an eos at position 0 is the end
    # of a document whose start is cut off).
    t = torch.tensor([[7, eos, bos, 8, 9, eos, bos, 10]])
    mask = document_causal_mask(document_ids(t, bos, eos))[0, 0]
    docs = [0, 0, 1, 1, 1, 1, 2, 2]
    expected = torch.tensor([[docs[q] == docs[k] and k <= q for k in range(8)] for q in range(8)])
    assert torch.equal(mask, expected)


def _doc(n, seed):
    body = torch.randint(0, 400, (n,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([torch.tensor([BOS]), body, torch.tensor([EOS])])


def _token_losses(model, t):
    logits = model(t[None, :-1])[0]
    return F.cross_entropy(logits.float(), t[1:], reduction="none")


def test_document_masking_equals_each_document_on_its_own():
    """Packed documents under document masking give each document the losses it gets alone.
    RoPE scores depend only on relative positions, so a document shifted to another offset
    sees the same attention up to the rounding of other rotation angles: fp32 angles up to
    36 rad are off by <= 36 x 2**-24 = 2e-6 rad, and the losses by about that relative
    (measured 1.1e-7); without the mask the later documents' losses move by 0.08-0.17."""
    masked = build(document_masking=True, bos_id=BOS, eos_id=EOS)
    plain = build()
    docs = [_doc(11, 1), _doc(17, 2), _doc(8, 3)]
    packed = torch.cat(docs)
    with torch.no_grad():
        together = _token_losses(masked, packed)
        unmasked = _token_losses(plain, packed)
        start = 0
        for d in docs:
            alone = _token_losses(masked, d)
            # Positions start..start+len-2 predict the document's own next tokens.
            got = together[start : start + len(d) - 1]
            torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
            if start:
                assert (unmasked[start : start + len(d) - 1] - alone).abs().max() > 1e-2
            start += len(d)


def _doc_batch(roll):
    """[2, 256] packed documents that cross 128-token mask blocks, split differently in each
    row (and, by `roll`, from one batch to the next)."""
    docs = torch.cat([_doc(n, seed) for seed, n in enumerate((150, 40, 3, 90), start=4)])
    t = docs[None, :256].repeat(2, 1).roll(roll, dims=1)
    t[1] = t[1].roll(77)
    return t


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_backend_equals_sdpa_mask():
    """The flex block mask masks exactly what the dense SDPA mask does: the same logits, with
    GQA and documents that cross 128-token mask blocks. Forward only: torch has no CPU backward
    for flex attention (training with it needs CUDA, where it is compiled)."""
    t = _doc_batch(0)
    logits = {}
    for backend in ("sdpa", "flex"):
        model = build(
            document_masking=True, bos_id=BOS, eos_id=EOS, n_kv_heads=4, max_seq_len=256,
            attention_backend=backend,
        )  # fmt: skip
        with torch.no_grad():
            logits[backend] = model(t)
    torch.testing.assert_close(logits["flex"], logits["sdpa"], rtol=1e-5, atol=1e-5)
    plain = build(n_kv_heads=4, max_seq_len=256)
    with torch.no_grad():
        assert (plain(t) - logits["flex"]).abs().max() > 1e-2  # the mask is not a no-op


@pytest.mark.slow  # compiles flex attention and its mask builder (~10 s of CPU)
def test_compiled_flex_builds_one_mask_per_forward_and_never_recompiles(monkeypatch):
    """Compiled as on a GPU, blocks too: one block mask per forward (for all 6 layers), and later
    steps with other document boundaries reuse the compiled graphs (a recompile raises here).
    aot_eager spares inductor's C++ build: whether dynamo recompiles depends on its guards, the
    same for every backend. The logits equal eager flex attention's."""
    batches = [_doc_batch(roll) for roll in (0, 77, 31)]
    model = build(
        document_masking=True, bos_id=BOS, eos_id=EOS, n_kv_heads=4, max_seq_len=256,
        attention_backend="flex",
    )  # fmt: skip
    with torch.no_grad():
        eager = [model(t) for t in batches]
    masks_built = []
    document_block_mask = model_module.document_block_mask

    def counted(doc, positions=None):
        masks_built.append(doc)
        return document_block_mask(doc, positions)

    compiled_fns = functools.cache(lambda fn: torch.compile(fn, backend="aot_eager"))
    monkeypatch.setattr(model_module, "document_block_mask", counted)
    monkeypatch.setattr(model_module, "_flex", lambda fn, device: compiled_fns(fn))
    apply_compile(model, "aot_eager")  # and the blocks, as --compile.enable does
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = [model(batches[0])]
        with torch._dynamo.config.patch(error_on_recompile=True):
            compiled += [model(t) for t in batches[1:]]
    assert len(masks_built) == len(batches)
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_flex_is_compiled_once_off_cpu_and_traced_inline_in_compiled_blocks(monkeypatch):
    """On a GPU, eager blocks call flex through one cached torch.compile wrapper; compiled blocks
    get the plain function, which dynamo traces into their graph."""
    cuda, create = torch.device("cuda"), model_module.create_block_mask
    assert model_module._flex(create, torch.device("cpu")) is create
    wrapped = model_module._flex(create, cuda)
    assert wrapped is not create and wrapped is model_module._flex(create, cuda)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert model_module._flex(create, cuda) is create


def test_flex_attention_backend_needs_document_masking():
    with pytest.raises(ValueError, match="flex only applies document masks"):
        build(attention_backend="flex")
    with pytest.raises(ValueError, match="is sdpa or flex, not Flex"):
        build(document_masking=True, bos_id=BOS, eos_id=EOS, attention_backend="Flex")


def test_flex_attn_flavor_is_document_masking():
    args = get_model_args("debugmodel_flex_attn", VOCAB, 64, bos_id=BOS, eos_id=EOS)
    assert args.document_masking and args.dim == LLAMA3_FLAVORS["debugmodel"].dim
    with pytest.raises(ValueError, match="needs the tokenizer's bos_id and eos_id"):
        get_model_args("debugmodel_flex_attn", VOCAB, 64)


def test_a_flavor_with_fewer_blocks_keeps_the_block_shape():
    """ "8B_4L": 8B's blocks, four of them (a big model's block shape on one GPU)."""
    four = get_model_args("8B_4L", vocab_size=1024, max_seq_len=64)
    assert four == get_model_args("8B", vocab_size=1024, max_seq_len=64, n_layers=4)
    assert LLAMA3_FLAVORS["8B"].n_layers == 32  # the table is not touched
    assert get_model_args("1B_2L_flex_attn", 1024, 64, bos_id=1, eos_id=2).n_layers == 2
    with pytest.raises(ConfigError, match="_<N>L"):
        get_model_args("9B_4L", vocab_size=1024, max_seq_len=64)
