"""Text generation from a titanlite model: a KV cache, batched prompts, sampling, stops.

The model module is not changed: a `KVCache` is attached from outside for the length of one
generation by swapping each attention's `attend` (the hook context parallelism uses as well) for
one that appends the new keys and values to the cache and attends over all of it, and put back
afterwards, so training never runs through it. Each step then feeds only the new tokens, at their
positions (`positions=` of the model's forward).

Batched prompts are left-padded to a common length; padding keys are masked. All sequences share
the slot positions 0..n-1, so a left-padded prompt's RoPE angles are shifted by its padding: the
scores depend only on the difference of two positions, so this is the same attention (up to
rounding) as the prompt alone at 0..n-1.

Decoding: temperature 0 is greedy (argmax); above 0 a token is sampled from
softmax(logits / temperature) over the top_k most likely tokens (0 = all) and then the smallest
set whose probability reaches top_p (1 = all), by a seeded generator. The vocabulary's padding
rows (past the tokenizer's n_words) are never chosen. A sequence stops at EOS (kept out of its
output) or when its text contains a stop string (the text is cut before it); the batch stops when
every sequence has.
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: every token
    top_p: float = 1.0  # 1: every token
    stop: tuple[str, ...] = ()  # stop strings
    stop_at_eos: bool = True
    seed: int = 0


class KVCache:
    """Keys and values of every layer for `batch` sequences of up to `length` slots. `valid[b, j]`:
    slot j of sequence b holds a real token (not left padding)."""

    def __init__(self, valid: torch.Tensor, length: int):
        self.valid = F.pad(valid, (0, length - valid.shape[1]), value=True)  # [b, length]
        self.length = length
        self.filled = 0  # slots written so far, the same in every layer
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _attend(self, layer: int, q, k, v, mask=None):
        """q [b, hq, s, hd], the new k, v [b, hkv, s, hd] -> [b, hq, s, hd] over all slots so far.
        `mask` (a document mask of the new tokens alone) is ignored: one prompt, one document."""
        if layer not in self.kv:  # shapes as this rank sees them (TP: its share of the heads)
            shape = (k.shape[0], k.shape[1], self.length, k.shape[3])
            self.kv[layer] = (k.new_empty(shape), v.new_empty(shape))
        keys, values = self.kv[layer]
        start, end = self.filled, self.filled + q.shape[2]
        keys[:, :, start:end], values[:, :, start:end] = k, v
        slots = torch.arange(end, device=q.device)
        causal = slots[None, :] <= slots[start:end, None]  # [s, end]
        # A padding query sees itself: a row with no key at all would be NaN, and later layers'
        # padding values (masked, weight 0) would turn every score they meet into NaN.
        allowed = causal & (self.valid[:, None, None, :end] | (slots == slots[start:end, None]))
        return F.scaled_dot_product_attention(
            q, keys[:, :, :end], values[:, :, :end], attn_mask=allowed,
            enable_gqa=q.shape[1] != k.shape[1],
        )  # fmt: skip

    @contextlib.contextmanager
    def attached(self, model):
        """The model attends through this cache inside the block, as before outside it."""
        attentions = [layer.attention for layer in model.layers.values()]
        saved = [a.attend for a in attentions]
        for i, a in enumerate(attentions):
            a.attend = lambda q, k, v, mask=None, i=i: self._attend(i, q, k, v, mask)
        try:
            yield self
        finally:
            for a, attend in zip(attentions, saved, strict=True):
                a.attend = attend


def full(logits):
    """Logits a TP plan left sharded over the vocabulary, gathered."""
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def next_token(logits, sampling: Sampling, n_words: int, generator) -> torch.Tensor:
    """logits [b, vocab] -> token ids [b]; the vocabulary's padding ids are never chosen."""
    logits = logits[:, :n_words].float()
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, n_words), dim=-1).values[:, -1:]  # [b, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the more likely ones already reach top_p (the first always stays).
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= sampling.top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _left_padded(prompts: list[list[int]], device) -> tuple[torch.Tensor, ...]:
    """Token ids [b, width] (padding: id 0, masked) and which of them are the prompts'."""
    width = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool, device=device)
    for row, p in enumerate(prompts):
        tokens[row, width - len(p) :] = torch.tensor(p, device=device)
        valid[row, width - len(p) :] = True
    return tokens, valid


class _Stops:
    """Per sequence: its new tokens, and whether it has stopped (EOS or a stop string)."""

    def __init__(self, n: int, tokenizer, sampling: Sampling):
        self.tokenizer, self.sampling = tokenizer, sampling
        self.out: list[list[int]] = [[] for _ in range(n)]
        self.done = [False] * n

    def add(self, new: list[int]) -> None:
        for row, token in enumerate(new):
            if self.done[row]:
                continue
            if self.sampling.stop_at_eos and token == self.tokenizer.eos_id:
                self.done[row] = True
                continue
            self.out[row].append(token)
            if self.sampling.stop:
                text = self.tokenizer.decode(self.out[row])
                self.done[row] = any(s in text for s in self.sampling.stop)

    def texts(self) -> list[str]:
        """Each output's text, cut before the first stop string in it."""
        texts = []
        for ids in self.out:
            text = self.tokenizer.decode(ids)
            cuts = [text.find(s) for s in self.sampling.stop if s in text]
            texts.append(text[: min(cuts)] if cuts else text)
        return texts


@dataclass
class Generation:
    ids: list[list[int]]  # each prompt's new tokens (EOS left out)
    texts: list[str]  # their text, cut before a stop string


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], sampling: Sampling, cache: bool = True):
    """Continue each prompt (token ids, BOS included if wanted) -> Generation. Without `cache`
    each new token re-runs the whole sequence, one sequence at a time: the reference, and the
    path for layouts whose attention cannot take the cache."""
    device = model.rope_cache.device
    generator = torch.Generator(device).manual_seed(sampling.seed)
    stops = _Stops(len(prompts), tokenizer, sampling)
    width = max(len(p) for p in prompts)
    if width + sampling.max_new_tokens > model.args.max_seq_len:
        raise ValueError(
            f"prompt ({width} tokens) + max_new_tokens ({sampling.max_new_tokens}) exceeds the "
            f"model's max_seq_len {model.args.max_seq_len}"
        )
    steps = (_cached_steps if cache else _uncached_steps)(
        model, prompts, width + sampling.max_new_tokens
    )
    logits = next(steps)
    for n in range(1, sampling.max_new_tokens + 1):
        chosen = next_token(logits, sampling, tokenizer.n_words, generator)
        stops.add(chosen.tolist())
        if all(stops.done) or n == sampling.max_new_tokens:
            break
        logits = steps.send(chosen)
    steps.close()
    return Generation(stops.out, stops.texts())


def _cached_steps(model, prompts, length):
    """Generator: yields the last position's logits [b, vocab], is sent the tokens chosen [b].
    The prompts go through in one forward, each new token in one more."""
    tokens, valid = _left_padded(prompts, model.rope_cache.device)
    kv = KVCache(valid, length)
    with kv.attached(model):
        while True:
            positions = torch.arange(kv.filled, kv.filled + tokens.shape[1], device=tokens.device)
            logits = full(model(tokens, positions=positions))[:, -1]
            kv.filled += tokens.shape[1]
            tokens = (yield logits)[:, None]


def _uncached_steps(model, prompts, _length):
    """The same, re-running each whole sequence alone for each new token."""
    rows = [torch.tensor(p, device=model.rope_cache.device) for p in prompts]
    while True:
        chosen = yield torch.stack([full(model(r[None]))[0, -1] for r in rows])
        rows = [torch.cat([r, c[None]]) for r, c in zip(rows, chosen, strict=True)]
