"""The optimizer step alone: AdamW (fp32 and bf16 states) against the Muon recipe (Muon on the
hidden matrices, AdamW on the rest) on a model flavor, on this machine.

    python scripts/bench_optimizer.py --flavor debugmodel --steps 10
    python -m torch.distributed.run --nproc-per-node 2 scripts/bench_optimizer.py --comm

One process: the median seconds of optimizer.step() over --steps steps with fixed random
gradients (interleaved, so a load change hits both alike) and the bytes of optimizer state. With
--comm, under torchrun (gloo), the Muon step of the matrices sharded by rows over every rank
(FSDP's layout) and the bytes each rank receives per step, counted at titanlite's calls: the
all-gather of each fp32 update ((W - 1) / W of it) and the owner's bf16 broadcast (the whole
result, except on the owner).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from titanlite.build import model_args_for_vocab  # noqa: E402
from titanlite.config import Optimizer  # noqa: E402
from titanlite.config_parse import parse_args  # noqa: E402
from titanlite.models import get_family  # noqa: E402
from titanlite.optim import build_optimizer  # noqa: E402
from titanlite.optim import muon as muon_module  # noqa: E402


def build(flavor: str, vocab: int) -> torch.nn.Module:
    cfg = parse_args(["--model.flavor", flavor])
    torch.manual_seed(0)
    model = get_family("llama3").model_cls(model_args_for_vocab(cfg, vocab))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return model


def state_bytes(opt) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if torch.is_tensor(t))  # fmt: skip


def time_steps(args) -> None:
    model = build(args.flavor, args.vocab)
    configs = {
        "AdamW": Optimizer(name="AdamW"),
        "AdamW, bf16 states": Optimizer(name="AdamW", state_dtype="bfloat16"),
        "Muon": Optimizer(name="Muon"),
    }
    opts = {name: build_optimizer(model, cfg) for name, cfg in configs.items()}
    times = {name: [] for name in opts}
    for _ in range(args.steps + 1):  # the first step allocates the states: not timed
        for name, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.flavor}: {params / 1e6:.1f} M params, {torch.get_num_threads()} threads")
    for name, opt in opts.items():
        ms = statistics.median(times[name][1:]) * 1e3
        print(f"{name:18s} step {ms:8.1f} ms (median of {args.steps})  "
              f"state {state_bytes(opt) / 2**20:8.1f} MiB")  # fmt: skip


def count_comm(args) -> None:
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    full = build(args.flavor, args.vocab)
    matrices = [p for n, p in full.named_parameters() if p.ndim == 2 and n.startswith("layers.")]
    params = []
    for p in matrices:  # as FSDP holds them: rows sharded over every rank
        shard = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
        shard.grad = distribute_tensor(p.grad, mesh, [Shard(0)])
        params.append(shard)
    received = {"all-gather": 0, "broadcast": 0}
    full_tensor, broadcast = DTensor.full_tensor, dist.broadcast

    def counted_full_tensor(self, **kw):
        out = full_tensor(self, **kw)
        received["all-gather"] += out.numel() * out.element_size() * (world - 1) // world
        return out

    def counted_broadcast(tensor, src, group=None, **kw):
        if src != rank:
            received["broadcast"] += tensor.numel() * tensor.element_size()
        return broadcast(tensor, src, group=group, **kw)

    DTensor.full_tensor, muon_module.dist.broadcast = counted_full_tensor, counted_broadcast
    opt = muon_module.Muon(params, lr=1e-3)
    t0 = time.perf_counter()
    opt.step()
    seconds = time.perf_counter() - t0
    elements = sum(p.numel() for p in matrices)
    lines = dist.get_rank() == 0 and [f"{len(matrices)} matrices, {elements / 1e6:.2f} M elements"]
    for r in range(world):
        if r == rank:
            print(
                f"rank {rank}/{world}: received per Muon step: all-gather "
                f"{received['all-gather'] / 2**20:.2f} MiB, broadcast "
                f"{received['broadcast'] / 2**20:.2f} MiB; step {seconds:.2f} s",
                flush=True,
            )
        dist.barrier()
    if lines:
        print(*lines)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--comm", action="store_true", help="count Muon's bytes under torchrun")
    args = parser.parse_args()
    count_comm(args) if args.comm else time_steps(args)
