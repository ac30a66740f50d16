"""Qwen3 against transformers' Qwen3ForCausalLM (a small random config, built locally): the same
logits in fp32, a bitwise round trip through the HF layout, the same loss at step 1 and after an
optimizer step; tied and untied flavors."""

import pytest
import torch

from titanlite.models import get_family, pad_vocab

transformers = pytest.importorskip("transformers")
QWEN3 = get_family("qwen3")


def randomized(flavor: str, seed: int = 0):
    """A Qwen3 model in fp32 whose every weight, the norms' too, is random (norms left at 1 would
    not see a wrong RoPE order of the QK-norm weights)."""
    args = QWEN3.model_args(flavor, vocab_size=pad_vocab(300), max_seq_len=64)
    model = QWEN3.model_cls(args)
    model.init_weights(seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
    return model


def hf_twin(model):
    args = model.args
    cfg = transformers.Qwen3Config(**QWEN3.hf.config(args, "float32"))
    hf = transformers.Qwen3ForCausalLM(cfg).float().eval()
    sd = QWEN3.hf.to_hf(model.state_dict(), args, torch.float32)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected
    assert set(missing) == ({"lm_head.weight"} if args.tie_embeddings else set())
    if args.tie_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf


def tokens(model, seed=1, batch=2, seq=33):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.args.vocab_size, (batch, seq), generator=gen)


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_tied"])
def test_logits_match_transformers_in_fp32(flavor):
    model = randomized(flavor).eval()
    hf = hf_twin(model)
    x = tokens(model)
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_tied"])
def test_the_round_trip_through_the_hf_layout_is_bitwise(flavor):
    model = randomized(flavor)
    sd = model.state_dict()
    hf_sd = QWEN3.hf.to_hf(sd, model.args, torch.float32)
    cfg = QWEN3.hf.config(model.args, "float32")
    convert = QWEN3.hf.from_hf_lazily(hf_sd.__getitem__, cfg, torch.float32)
    back = {ours: make() for ours, (_, make) in convert.items()}
    assert back.keys() == sd.keys()
    for name, w in sd.items():
        assert torch.equal(back[name], w), name


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_tied"])
def test_the_loss_matches_at_step_one_and_after_a_step(flavor):
    """Our summed CE over the shifted targets (plain and chunked) against HF's mean loss, before
    and after one SGD step on each: the same gradients (the tied weight's included) move both
    alike. SGD, not AdamW: AdamW's first step is about lr x sign(gradient) per element, so an
    element whose gradient is rounding noise (summed in another order by each) moves by +-lr on
    one side and -+lr on the other, a difference that says nothing of the gradients."""
    model = randomized(flavor)
    hf = hf_twin(model).train()
    x = tokens(model)
    inputs, labels = x[:, :-1], x[:, 1:]
    opts = [torch.optim.SGD(m.parameters(), lr=1.0) for m in (model, hf)]
    losses = []
    for _ in range(2):
        ours = model(inputs, labels) / labels.numel()
        chunked = model(inputs, labels, chunk_tokens=16) / labels.numel()
        theirs = hf(x, labels=x).loss
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
        torch.testing.assert_close(chunked, theirs, atol=1e-5, rtol=0)
        losses.append(ours.item())
        for loss, opt in zip((ours, theirs), opts, strict=True):
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert losses[0] - losses[1] > 1e-3  # the step moved the weights enough to show in the loss


def test_the_published_shapes_count_their_parameters():
    """0.6B: 596,049,920 parameters with the tied embedding (the release's count)."""
    args = QWEN3.model_args("0.6B", vocab_size=151936, max_seq_len=4096)
    with torch.device("meta"):
        model = QWEN3.model_cls(args)
    assert sum(p.numel() for p in model.parameters()) == 596_049_920
    assert model.output.weight is model.tok_embeddings.weight  # read, not held
    assert "output.weight" not in model.state_dict()
