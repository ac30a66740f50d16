"""What a mixture's per-source training loss (loss/<name>) costs: per step, and per log step.

    python scripts/benchmarks/bench_source_loss.py --steps 8 --sources 3

One process (--device cpu or cuda), the debug shape (debug_model.toml: debugmodel flavour,
vocab 2048, seq_len 256, local batch 8, one microbatch) on random tokens. Per step it times,
interleaved so that load changes on a shared machine hit both alike:
- `plain`: train.py's forward_backward without sources (a one-source run);
- `sources`: the same with the rows' sources, including what the trainer adds every step
  (StepSources: one-hot rows, host token counts) and the loader thread's blend walk for the
  step's rows (MixtureOrder.sources, timed apart: it runs beside the model, not in the step);
and apart, the added work alone (StepSources and the per-source sums of a step's per-token
losses, `by_source`), which on a loaded machine is measurable where the step's difference is
noise; per log step the extra host read of source_losses (one process: no collective).
--chunk-tokens N times the chunked loss instead of the plain one.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from titanlite.data.mixture import MixtureOrder, Part  # noqa: E402
from titanlite.loss import by_source  # noqa: E402
from titanlite.models import get_family  # noqa: E402
from titanlite.source_loss import StepSources, source_losses  # noqa: E402
from train import forward_backward  # noqa: E402


def blend(sources: int) -> MixtureOrder:
    """A MixtureOrder of `sources` sources (weights 1/2, 1/4, ...): only its walk is timed."""
    weights = np.array([2.0**-k for k in range(sources)])
    parts = [Part(f"s{k}", w, None, 0) for k, w in enumerate(weights / weights.sum())]
    return MixtureOrder(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    p.add_argument("--sources", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--chunk-tokens", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    device = torch.device(a.device)
    llama = get_family("llama3")
    model = llama.model_cls(llama.model_args("debugmodel", vocab_size=2048, max_seq_len=a.seq_len))
    model.to(device).init_weights(seed=0)
    host = torch.randint(0, 2048, (a.batch, a.seq_len))
    labels = torch.roll(host, -1, 1)
    microbatches = [(host.to(device), labels.to(device))]
    scale = torch.tensor(1.0 / host.numel(), device=device)
    order = blend(a.sources)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    times = {"plain": [], "sources": [], "walk": [], "log read": [], "added": []}
    token_losses = torch.rand(host.numel(), device=device)
    for step in range(a.steps + 1):  # the first of each: warm-up, not kept
        sync()
        t0 = time.perf_counter()
        forward_backward(model, microbatches, scale, chunk_tokens=a.chunk_tokens)
        sync()
        t1 = time.perf_counter()
        rows = [torch.from_numpy(order.sources(step * a.batch, (step + 1) * a.batch))]
        t2 = time.perf_counter()
        sources = StepSources(rows, [(host, labels)], a.sources, device)  # from the host labels
        sums = forward_backward(
            model, microbatches, scale, chunk_tokens=a.chunk_tokens, sources=sources
        )
        sync()
        t3 = time.perf_counter()
        source_losses([f"s{k}" for k in range(a.sources)], sums[1:], sources.tokens)
        t4 = time.perf_counter()
        added = StepSources(rows, [(host, labels)], a.sources, device)
        by_source(token_losses, host, added.rows[0])
        sync()
        t5 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        if step:
            times["plain"].append(t1 - t0)
            times["walk"].append(t2 - t1)
            times["sources"].append(t3 - t2)
            times["log read"].append(t4 - t3)
            times["added"].append(t5 - t4)
    plain, extra = statistics.median(times["plain"]), statistics.median(times["sources"])
    print(f"debug shape: batch {a.batch} x seq {a.seq_len}, {a.sources} sources, "
          f"chunk_tokens {a.chunk_tokens}, {a.steps} steps each, medians:")  # fmt: skip
    print(f"  forward+backward, one source:        {plain * 1e3:9.2f} ms")
    print(f"  forward+backward, per-source sums:    {extra * 1e3:9.2f} ms "
          f"({100 * (extra - plain) / plain:+.2f}%)")  # fmt: skip
    walk, read, added = (statistics.median(times[k]) * 1e3 for k in ("walk", "log read", "added"))
    print(f"  added work alone (rows, sums):        {added:9.3f} ms")
    print(f"  blend walk of the step's rows:        {walk:9.3f} ms (loader thread)")
    print(f"  log step: source_losses host read:    {read:9.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
