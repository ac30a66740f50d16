"""CPU attention under bf16: torch's bf16 flash backward against the same kernel's fp32 one.

    python scripts/benchmarks/bench_cpu_attention.py [--threads 2] [--rounds 6]

titanlite's `sdpa` runs the backward of bf16 attention in fp32 on CPU at head_dim <= 64
(`fp32_backward` in titanlite/models/kernels.py). This measures both sides of that choice:

1. Per head_dim (16, 32, 64, 128; width 256, so 16 to 2 heads; batch 8 x 256 tokens, causal):
   the forward and the backward, median of 9 calls, of the bf16 kernel and of the fp32 kernel
   with its casts; and each backward's gradients against an fp64 backward of the same bf16
   inputs (relative error of the whole tensor, the worst of dq, dk and dv).
2. The debug model's bf16 step (bf16 weights, document masks, fused AdamW), in blocks of 3 steps
   alternating the fp32 backward and SDPA's bf16 kernel, `--rounds` times: each round's step
   time ratio, and their median on the last line, `fp32 backward / bf16 kernel X.XXX`.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from titanlite.models import kernels as model_kernels  # noqa: E402
from titanlite.models.decoder import model as llama  # noqa: E402
from titanlite.models.llama.args import get_model_args  # noqa: E402

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def median_ms(fn, calls: int = 9) -> float:
    fn()  # warm-up
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def kernels(head_dim: int, width: int = 256, batch: int = 8, seq: int = 256) -> str:
    g = torch.Generator().manual_seed(0)
    shape = (batch, width // head_dim, seq, head_dim)
    q, k, v, grad = (torch.randn(shape, generator=g, dtype=torch.bfloat16) for _ in range(4))
    out, lse = FLASH(q, k, v, 0.0, True)

    def fp32(*ts):
        return [t.float() for t in ts]

    def backward_bf16():
        return FLASH_BACKWARD(grad, q, k, v, out, lse, 0.0, True)

    def backward_fp32():
        grads = FLASH_BACKWARD(*fp32(grad, q, k, v, out), lse, 0.0, True)
        return [t.to(torch.bfloat16) for t in grads]

    exact = [t.double().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*exact, is_causal=True).backward(grad.double())

    def error(grads) -> float:
        return max(
            ((d.double() - e.grad).norm() / e.grad.norm()).item()
            for d, e in zip(grads, exact, strict=True)
        )

    times = [
        median_ms(lambda: FLASH(q, k, v, 0.0, True)),
        median_ms(lambda: FLASH(*fp32(q, k, v), 0.0, True)[0].to(torch.bfloat16)),
        median_ms(backward_bf16),
        median_ms(backward_fp32),
    ]
    cells = [head_dim, shape[1], *(f"{t:.1f}" for t in times)]
    cells += [f"{error(backward_bf16()):.2e}", f"{error(backward_fp32()):.2e}"]
    return "| " + " | ".join(map(str, cells)) + " |"


def step_ratio(rounds: int) -> float:
    vocab, bos, eos = 2048, 2046, 2047
    args = get_model_args("debugmodel", vocab, 256, document_masking=True, bos_id=bos, eos_id=eos)
    model = llama.Transformer(args)
    model.init_weights(0)
    model.to(torch.bfloat16).init_buffers()  # RoPE's cache stays fp32, as in training
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, bos, (8, 256), generator=g)
    tokens[:, 99:101] = torch.tensor([eos, bos])  # two documents per row
    labels = torch.randint(0, vocab, (8, 256), generator=g)

    def step():
        loss = model(tokens, labels, documents=model.documents(tokens)) / labels.numel()
        loss.backward()
        opt.step()
        opt.zero_grad()

    choice = model_kernels.fp32_backward
    ratios = []
    for r in range(rounds):
        ms = {}
        for name, rule in (("bf16 kernel", lambda q: False), ("fp32 backward", choice)):
            model_kernels.fp32_backward = rule
            step()  # warm-up after the switch
            ms[name] = median_ms(step, calls=3)
        ratios.append(ms["fp32 backward"] / ms["bf16 kernel"])
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.0f} ms" for k, v in ms.items()))
    model_kernels.fp32_backward = choice
    print("per-round ratios: " + ", ".join(f"{x:.3f}" for x in ratios))
    return statistics.median(ratios)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of the step comparison")
    args = ap.parse_args()
    if args.threads < 1 or args.rounds < 1:
        ap.error("--threads and --rounds must be positive")
    torch.set_num_threads(args.threads)
    print(f"{torch.__version__}, {args.threads} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}")  # fmt: skip
    print("| head_dim | heads | forward bf16 ms | forward fp32 + casts ms | backward bf16 ms | "
          "backward fp32 + casts ms | bf16 backward's error | fp32 backward's error |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for head_dim in (16, 32, 64, 128):
        print(kernels(head_dim))
    print(f"fp32 backward / bf16 kernel {step_ratio(args.rounds):.3f}")


if __name__ == "__main__":
    main()
