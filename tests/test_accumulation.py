"""Exact token-normalized gradient accumulation: the loss of a step is the sum of per-token
cross-entropy over the whole global batch divided by its target-token count, however the batch is
split over ranks and microbatches, and whether FSDP syncs grads every or only the last
microbatch."""

import json
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import read_jsonl, run_train
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import train
from titanlite.models.llama.args import ModelArgs
from titanlite.models.llama.model import Transformer

RTOL = 1e-5
STEPS = 3
SEQ_LEN = 64

# (ranks, rows per microbatch): global batch 8 = ranks x rows x microbatches.
SPLITS = {
    "1x8x1": (1, 8),
    "1x1x8": (1, 1),
    "2x2x2": (2, 2),
    "4x1x2": (4, 1),
}
CASES = [("1x8x1", "every"), ("1x1x8", "every")]
CASES += [(s, sync) for s in ("2x2x2", "4x1x2") for sync in ("every", "last")]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Documents of 1 to ~60 tokens: without packing one per row, so rows (and microbatches, and
    ranks) hold very different numbers of target tokens and a mean of means would be wrong."""
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "then"]
    with path.open("w") as f:
        for i in range(64):
            n = (i * 37) % 55  # 0..54 words, scrambled so each batch mixes lengths
            f.write(json.dumps({"text": " ".join(words[j % 11] for j in range(n))}) + "\n")
    return path


def run(corpus, dump, split, sync):
    ranks, rows = SPLITS[split]
    args = [
        "--job.config_file", "debug_model.toml",
        "--model.vocab_limit", "512",
        "--training.dataset", "local",
        "--training.dataset_path", str(corpus),
        "--no-training.packing",
        "--training.seq_len", str(SEQ_LEN),
        "--training.local_batch_size", str(rows),
        "--training.global_batch_size", "8",
        "--training.steps", str(STEPS),
        "--training.accumulation_sync", sync,
        "--training.mixed_precision_param", "float32",
        "--lr_scheduler.warmup_steps", "2",
        "--metrics.log_freq", "1",
        "--metrics.peak_tflops", "1",
        "--no-metrics.enable_tensorboard",
        "--checkpoint.enable",
        "--checkpoint.interval", "1000",  # only the last step is saved
        "--job.dump_folder", str(dump),
    ]  # fmt: skip
    run_train(args, nproc=ranks)
    losses = [r["loss"] for r in read_jsonl(dump / "metrics.jsonl")]
    assert len(losses) == STEPS
    torch_file = dump / "final.pt"
    dcp_to_torch_save(dump / "checkpoint" / f"step-{STEPS}", torch_file)
    weights = torch.load(torch_file, weights_only=False)["model"]
    return losses, weights


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference relative to the reference tensor's largest magnitude."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    return run(corpus, tmp_path_factory.mktemp("ref"), *CASES[0])


@pytest.mark.parametrize("split, sync", CASES[1:], ids=[f"{s}-{y}" for s, y in CASES[1:]])
def test_split_gives_same_losses_and_weights(split, sync, reference, corpus, tmp_path):
    ref_losses, ref_weights = reference
    losses, weights = run(corpus, tmp_path, split, sync)
    loss_dev = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    assert weights.keys() == ref_weights.keys()
    devs = {k: rel(weights[k], ref_weights[k]) for k in ref_weights}
    worst = max(devs, key=devs.get)
    print(
        f"\n{split} sync={sync}: worst relative deviation vs 1x8x1: loss {loss_dev:.2e}, "
        f"weights {devs[worst]:.2e} ({worst})"
    )
    assert loss_dev <= RTOL, (losses, ref_losses)
    assert devs[worst] <= RTOL, devs


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
    loss_sum, global_tokens = train.Trainer.forward_backward(trainer_stub(model), microbatches)
    assert global_tokens.item() == 28
    trainer_loss = (loss_sum / global_tokens).item()

    assert trainer_loss == pytest.approx(naive.item(), rel=1e-6)
    for n, p in model.named_parameters():
        worst = rel(p.grad, naive_grads[n])
        assert worst <= 1e-6, (n, worst)


def trainer_stub(model):
    """Just the attributes Trainer.forward_backward reads, for one process on the CPU."""
    cfg = types.SimpleNamespace(
        training=types.SimpleNamespace(accumulation_sync="every"),
        loss=types.SimpleNamespace(chunk_tokens=0),
    )
    return types.SimpleNamespace(
        cfg=cfg,
        model=model,
        device=torch.device("cpu"),
        parallel_dims=types.SimpleNamespace(dp_mesh=None, fsdp_enabled=False),
        loss_parallel=train.contextlib.nullcontext,
        autocast=train.contextlib.nullcontext,
    )
