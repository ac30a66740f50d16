"""Exact token-normalized gradient accumulation in the trainer's own step code: the loss of a
step is the sum of per-token cross-entropy over the whole global batch divided by its
target-token count, however the batch is split into microbatches (the same in real runs over
ranks and microbatches: tests/integration/test_accumulation.py)."""

import pytest
import torch
import torch.nn.functional as F
from numerics import rel

import train
from titanlite.models.decoder.model import Transformer
from titanlite.models.llama.args import ModelArgs


def naive_batch(vocab: int, gen: torch.Generator):
    """A global batch of 4 rows, seq 16, with 16, 9, 3 and 0 target tokens (-100 elsewhere)."""
    tokens = torch.randint(0, vocab, (4, 16), generator=gen)
    labels = torch.randint(0, vocab, (4, 16), generator=gen)
    for row, keep in enumerate((16, 9, 3, 0)):
        labels[row, keep:] = -100
    return tokens, labels


def test_trainer_step_equals_one_mean_over_the_global_batch():
    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=16)
    model = Transformer(args).double()  # fp64: the two methods differ only in summation order
    model.init_weights()
    tokens, labels = naive_batch(args.vocab_size, torch.Generator().manual_seed(1))

    # Naive: one forward over the whole batch, mean over its 28 target tokens.
    logits = model(tokens)  # [b, s, vocab]
    naive = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="mean")
    naive.backward()
    naive_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    # The trainer's own step code on uneven microbatches (rows 1 | 2 | 1): sum x (1 / 28).
    microbatches = [(tokens[:1], labels[:1]), (tokens[1:3], labels[1:3]), (tokens[3:], labels[3:])]
    global_tokens, _, _ = train.count_step_tokens(microbatches, True, False, torch.device("cpu"))
    assert global_tokens.item() == 28
    loss_sum = train.forward_backward(model, microbatches, 1.0 / global_tokens.double())
    trainer_loss = (loss_sum / global_tokens).item()

    assert trainer_loss == pytest.approx(naive.item(), rel=1e-6)
    for n, p in model.named_parameters():
        worst = rel(p.grad, naive_grads[n])
        assert worst <= 1e-6, (n, worst)
