"""titanlite.eval.generate: the KV cache gives the tokens of the plain model's full forwards
(batched, left-padded prompts), leaves the model as it was, and sampling and stops do what they
say. (Against transformers on an export: tests/test_hf_export.py.)"""

import copy
from types import SimpleNamespace

import pytest
import torch

from titanlite.eval.generate import Sampling, _cached_steps, generate, next_token
from titanlite.models.decoder.model import Transformer, causal_attention
from titanlite.models.llama.args import get_model_args

VOCAB = 256
PROMPTS = [[1, 5, 9, 200, 17, 3, 3, 8], [1, 44], [1, 7, 7, 7, 120]]


@pytest.fixture(scope="module")
def model():
    """GQA (2 kv heads per 4), logits spread out so greedy choices are far from ties."""
    torch.manual_seed(0)
    args = get_model_args("debugmodel", vocab_size=VOCAB, max_seq_len=64, n_kv_heads=4)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():
        model.output.weight.mul_(8)
    return model.eval()


def tokenizer(eos_id=-1, n_words=VOCAB - 6):
    """Ids as text: one letter per id, so stop strings are easy to place."""
    decode = lambda ids: "".join(chr(ord("A") + i % 26) for i in ids)  # noqa: E731
    return SimpleNamespace(eos_id=eos_id, n_words=n_words, decode=decode)


def test_cached_greedy_is_the_full_forwards_greedy(model):
    greedy = Sampling(max_new_tokens=12)
    cached = generate(model, tokenizer(), PROMPTS, greedy)
    plain = generate(model, tokenizer(), PROMPTS, greedy, cache=False)
    assert cached.ids == plain.ids and all(len(ids) == 12 for ids in cached.ids)
    alone = [generate(model, tokenizer(), [p], greedy).ids[0] for p in PROMPTS]
    assert cached.ids == alone  # left padding changes nothing
    assert all(a.attend is causal_attention for a in (b.attention for b in model.layers.values()))


def test_eos_and_stop_strings_end_each_sequence(model):
    free = generate(model, tokenizer(), PROMPTS, Sampling(max_new_tokens=12)).ids
    eos = free[0][3]  # the first sequence's fourth new token
    out = generate(model, tokenizer(eos_id=eos), PROMPTS, Sampling(max_new_tokens=12))
    assert out.ids[0] == free[0][: free[0].index(eos)]
    stop = tokenizer().decode(free[1][4:6])
    out = generate(model, tokenizer(), PROMPTS, Sampling(max_new_tokens=12, stop=(stop,)))
    text = tokenizer().decode(free[1])
    assert out.texts[1] == text[: text.find(stop)]
    assert stop in tokenizer().decode(out.ids[1]) and stop not in out.texts[1]


def test_sampling_is_seeded_and_keeps_to_top_k_top_p_and_the_vocabulary(model):
    hot = Sampling(max_new_tokens=8, temperature=1.5, top_k=5, seed=3)
    assert (
        generate(model, tokenizer(), PROMPTS, hot).ids
        == generate(model, tokenizer(), PROMPTS, hot).ids
    )
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 50.0, 60.0]]).repeat(400, 1)
    logits[:, 2] = 4.0  # ids 4, 5 are the vocabulary's padding: never chosen
    rng = torch.Generator().manual_seed(0)
    top_k = next_token(logits, Sampling(temperature=2.0, top_k=2), 4, rng)
    assert set(top_k.tolist()) == {2, 3}
    # probabilities of ids 0..3 at temperature 1: 0.03, 0.09, 0.64, 0.24: top_p 0.7 keeps 2 and 3
    top_p = next_token(logits, Sampling(temperature=1.0, top_p=0.7), 4, rng)
    assert set(top_p.tolist()) == {2, 3}
    assert next_token(logits, Sampling(), 4, rng).tolist() == [2] * 400


def test_a_too_long_generation_is_refused_before_any_forward(model):
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len 64"):
        generate(model, tokenizer(), PROMPTS, Sampling(max_new_tokens=60))


def test_cached_logits_are_each_prompts_own_full_forward(model):
    """Tokens alone would hide small errors (a padding key attended): compare the logits."""
    plain = copy.deepcopy(model)  # the cache stays attached to `model` between steps
    steps = _cached_steps(model, PROMPTS, length=20)
    logits = next(steps)
    rows = [torch.tensor(p) for p in PROMPTS]
    for _ in range(4):
        with torch.no_grad():
            want = torch.stack([plain(r[None])[0, -1] for r in rows])
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)
        chosen = want.argmax(-1)
        rows = [torch.cat([r, c[None]]) for r, c in zip(rows, chosen, strict=True)]
        logits = steps.send(chosen)
    steps.close()
