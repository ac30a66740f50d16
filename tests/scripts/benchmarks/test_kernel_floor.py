"""scripts/benchmarks/kernel_floor.py: it records exactly the step's matmuls and attention calls,
forward and backward, and replays them."""

import sys

import torch
from conftest import REPO
from torch import nn

sys.path.insert(0, str(REPO / "scripts" / "benchmarks"))
import kernel_floor  # noqa: E402
from kernel_floor import gemm_flops, record_kernels, time_kernels  # noqa: E402

from titanlite.models.decoder.model import Transformer  # noqa: E402
from titanlite.models.llama.args import ModelArgs  # noqa: E402


def _step(model, tokens):
    def step():
        model(tokens).float().sum().backward()

    return step


def test_a_step_records_three_matmuls_per_linear_and_one_attention_each_way_per_layer():
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=32)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    tokens = torch.randint(0, 128, (2, 32))
    calls = record_kernels(_step(model, tokens))
    by_op = {}
    for (func, _, _), count in calls.items():
        name = func.overloadpacket.__name__
        by_op[name] = by_op.get(name, 0) + count
    # 7 linears per block and the output layer: forward, input grad and weight grad each (the
    # first block's input grad too: the embedding's output needs one).
    assert by_op.pop("mm") == (7 * args.n_layers + 1) * 3
    assert sorted(by_op.items()) == [
        ("_scaled_dot_product_flash_attention_for_cpu", args.n_layers),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", args.n_layers),
    ]
    # Every linear's three products cost 2 x tokens x its weight's size each.
    linear_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    flops = sum(count * gemm_flops(func, args) for (func, args, _), count in calls.items())
    assert flops == 6 * tokens.numel() * linear_weights
    floor, rows = time_kernels(calls, torch.device("cpu"), iters=1)
    assert floor > 0 and floor == sum(secs for _, _, secs, _ in rows)
    assert {name: rate > 0 for name, _, _, rate in rows} == {
        "mm": True,
        "_scaled_dot_product_flash_attention_for_cpu": False,
        "_scaled_dot_product_flash_attention_for_cpu_backward": False,
    }
    assert {name for name, _, _, _ in rows} == {
        "mm",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    }
    assert sum(n for name, n, _, _ in rows if name == "mm") == (7 * args.n_layers + 1) * 3


def test_the_machine_rate_skips_bf16_where_it_is_emulated(monkeypatch, capsys):
    timed = []
    monkeypatch.setattr(
        kernel_floor, "matmul_rate", lambda dtype, threads: timed.append(dtype) or 1e9
    )
    monkeypatch.setattr(kernel_floor, "concurrent_rate", lambda dtype, procs: 2e9)
    for fast, expected in (
        (True, [torch.float32] * 2 + [torch.bfloat16] * 2),
        (False, [torch.float32] * 2),
    ):
        timed.clear()
        monkeypatch.setattr(kernel_floor, "has_fast_bf16", lambda device, fast=fast: fast)
        kernel_floor.main(["--procs", "2"])
        assert timed == expected
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "torch.bfloat16  not timed: emulated on this CPU (no AVX512-BF16 or AMX)"
    assert out[-2].startswith("torch.float32   1 thread     1.0 GFLOP/s")
