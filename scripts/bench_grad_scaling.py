"""What the old way of normalizing accumulated gradients costs: a `grad *= c` pass over every
gradient after backward, versus train.py's pre-scaled loss (`(loss_sum * scale).backward()`, one
scalar multiply in the graph per microbatch).

    python scripts/bench_grad_scaling.py [--reps 7] [--blocks 4] [--threads 2]

Prints a markdown table of medians. (a) the debug model's gradients (fp32, as trained);
(b) Llama 3 8B's gradients in bf16. 8B's 16 GB of bf16 grads do not fit next to everything else
on a small machine, so (b) allocates `--blocks` transformer blocks plus the embedding and output
matrices, times them, and scales the block part to 32 layers (the pass is memory-bound, so time is
linear in bytes; the table also shows 1 block vs `--blocks` blocks to check that).
"""

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from titanlite.config_parse import parse_args  # noqa: E402
from titanlite.data.tokenizer import build_tokenizer  # noqa: E402
from titanlite.models.llama.args import LLAMA3_FLAVORS, get_model_args, pad_vocab  # noqa: E402
from titanlite.models.llama.model import Transformer  # noqa: E402

LLAMA3_VOCAB = 128256


def median_s(fn, reps: int) -> float:
    fn()  # warm-up: first touch of the pages, allocator
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def for_loop(grads, c):
    for g in grads:
        g.mul_(c)


def foreach(grads, c):
    torch._foreach_mul_(grads, c)


def shapes(args, n_layers: int) -> tuple[list, list]:
    """(block shapes of n_layers blocks, shapes of the non-block params), from a meta build."""
    with torch.device("meta"):
        model = Transformer(replace(args, n_layers=n_layers))
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    return [s for n, s in named if n.startswith("layers.")], [
        s for n, s in named if not n.startswith("layers.")
    ]


def alloc(shape_list, dtype) -> list[torch.Tensor]:
    return [torch.ones(s, dtype=dtype) for s in shape_list]


def gib(grads) -> float:
    return sum(g.numel() * g.element_size() for g in grads) / 2**30


def debug_rows(reps: int, scale: torch.Tensor) -> list[tuple]:
    cfg = parse_args(["--job.config_file", "debug_model.toml"])
    vocab = pad_vocab(build_tokenizer(cfg.model).n_words)
    args = get_model_args(cfg.model.flavor, vocab, cfg.training.seq_len)
    blocks, rest = shapes(args, args.n_layers)
    grads = alloc(blocks + rest, torch.float32)
    what = f"debug model, fp32, {len(grads)} tensors, {gib(grads) * 1024:.1f} MiB"
    return [
        (what, "for-loop `g.mul_(c)`", median_s(lambda: for_loop(grads, scale), reps)),
        (what, "`torch._foreach_mul_`", median_s(lambda: foreach(grads, scale), reps)),
    ]


def llama8b_rows(reps: int, scale: torch.Tensor, k: int) -> list[tuple]:
    args = replace(LLAMA3_FLAVORS["8B"], vocab_size=LLAMA3_VOCAB)
    blocks, rest = shapes(args, k)
    per_block = len(blocks) // k
    block_grads = alloc(blocks, torch.bfloat16)
    rest_grads = alloc(rest, torch.bfloat16)
    total_gib = gib(rest_grads) + gib(block_grads) / k * args.n_layers
    rows = []
    for name, fn in (("for-loop `g.mul_(c)`", for_loop), ("`torch._foreach_mul_`", foreach)):
        t1 = median_s(lambda fn=fn: fn(block_grads[:per_block], scale), reps)
        tk = median_s(lambda fn=fn: fn(block_grads, scale), reps)
        t_rest = median_s(lambda fn=fn: fn(rest_grads, scale), reps)
        full = t_rest + tk / k * args.n_layers
        rows.append((f"8B, bf16, 1 block ({gib(block_grads) / k:.2f} GiB)", name, t1))
        rows.append((f"8B, bf16, {k} blocks ({gib(block_grads):.2f} GiB)", name, tk))
        rows.append((f"8B, bf16, embedding + output ({gib(rest_grads):.2f} GiB)", name, t_rest))
        rows.append((f"8B, bf16, all 32 layers, {total_gib:.1f} GiB (extrapolated)", name, full))
    return rows


def prescaled_rows(reps: int, scale: torch.Tensor) -> list[tuple]:
    """The pre-scaled loss: one 0-dim multiply in forward and one in backward, per microbatch."""
    loss = torch.ones((), requires_grad=True)  # stands for the microbatch's fp32 loss sum
    n = 1000  # one op is ~microseconds: time a batch of them, report per op

    def forward():
        for _ in range(n):
            loss * scale

    def forward_backward():
        for _ in range(n):
            (loss * scale).backward()

    what = "pre-scaled loss (any model), per microbatch"
    return [
        (what, "`loss_sum * scale` forward", median_s(forward, reps) / n),
        (what, "forward + backward of it (upper bound)", median_s(forward_backward, reps) / n),
    ]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=7, help="timed repetitions (median reported)")
    p.add_argument("--blocks", type=int, default=4, help="8B blocks actually allocated")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    # A 0-dim tensor as train.py's 1 / global tokens, but close to 1: the grads are scaled in place
    # over and over, and a real 1 / tokens would drive them into denormals (10-100x slower).
    scale = torch.tensor(0.999)
    rows = prescaled_rows(a.reps, scale) + debug_rows(a.reps, scale)
    rows += llama8b_rows(a.reps, scale, a.blocks)
    print(f"torch {torch.__version__}, {a.threads} threads, median of {a.reps}\n")
    print("| gradients | method | median time |")
    print("|---|---|---|")
    for what, method, t in rows:
        shown = f"{t * 1e6:.2f} us" if t < 1e-3 else f"{t * 1e3:.1f} ms"
        print(f"| {what} | {method} | {shown} |")


if __name__ == "__main__":
    main()
