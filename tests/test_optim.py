import math
from types import SimpleNamespace

import pytest
import torch

from titanlite.config import Optimizer
from titanlite.optim import (
    StepInBackward,
    build_lr_scheduler,
    build_optimizer,
    resolve_implementation,
)


def sched_cfg(**kw):
    base = dict(warmup_steps=4, decay_ratio=-1.0, decay_type="linear", min_lr_factor=0.0)
    return SimpleNamespace(**{**base, **kw})


def opt_cfg(**kw):
    return Optimizer(**{"lr": 1.0, **kw})


def lrs(sched_kw, total):
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, opt_cfg())
    sched = build_lr_scheduler(opt, sched_cfg(**sched_kw), total)
    out = []
    for _ in range(total):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def test_auto_implementation_is_fused_where_every_parameter_is_on_one_device():
    cuda, cpu = (SimpleNamespace(device=torch.device(d)) for d in ("cuda", "cpu"))
    assert resolve_implementation("auto", [cuda, cuda]) == "fused"
    assert resolve_implementation("auto", [cpu, cpu]) == "fused"
    assert resolve_implementation("auto", [cuda, cpu]) == "foreach"  # CPU offload of some
    assert resolve_implementation("for-loop", [cuda]) == "for-loop"
    opt = build_optimizer(torch.nn.Linear(2, 2), opt_cfg())
    adamw = opt.inner["AdamW"]
    assert adamw.defaults["fused"] and not adamw.defaults["foreach"]


def test_warmup_then_linear_decay_to_zero():
    lr = lrs({}, total=10)
    assert lr[:4] == pytest.approx([1 / 4, 2 / 4, 3 / 4, 1.0])
    assert lr[4] == pytest.approx(1.0)
    assert lr[9] == pytest.approx(1 - 5 / 6)  # still decaying at the last step: never 0 early
    assert all(a > b for a, b in zip(lr[4:], lr[5:]))


def test_warmup_longer_than_the_run_is_clamped_and_said(caplog):
    lr = lrs({"warmup_steps": 200}, total=4)
    assert lr == pytest.approx([1 / 4, 2 / 4, 3 / 4, 1.0])
    assert "warmup_steps (200) exceeds training.steps (4)" in caplog.text
    caplog.clear()
    lrs({"warmup_steps": 4}, total=4)
    assert "exceeds" not in caplog.text


def test_stable_phase_and_min_lr():
    lr = lrs({"decay_ratio": 0.5, "min_lr_factor": 0.1, "decay_type": "cosine"}, total=20)
    assert lr[4:10] == pytest.approx([1.0] * 6)  # stable until the last 50%
    assert lr[10] == pytest.approx(1.0)
    assert min(lr) >= 0.1
    expected_last = 0.1 + 0.9 * 0.5 * (1 + math.cos(0.9 * math.pi))
    assert lr[19] == pytest.approx(expected_last)


def test_sqrt_decay_shape():
    lr = lrs({"warmup_steps": 0, "decay_type": "sqrt"}, total=5)
    assert lr == pytest.approx([1 - (i / 5) ** 0.5 for i in range(5)])


def test_norm_weights_get_no_weight_decay():
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 3, bias=False), torch.nn.LayerNorm(3, bias=False)
    )
    opt = build_optimizer(model, opt_cfg())
    decayed, plain = opt.param_groups
    assert [p.shape for p in decayed["params"]] == [torch.Size([3, 3])]
    assert [p.shape for p in plain["params"]] == [torch.Size([3])]
    assert plain["weight_decay"] == 0.0


BATCHES = torch.randn(4, 16, 4, generator=torch.Generator().manual_seed(0))


def _tiny_run(steps, early, resume=None):
    """AdamW steps of a small model (2-D weights decayed, 1-D not) under a warmup schedule, from
    fixed weights and batches; from `resume` = (step, state) if given. Returns the model, its
    optimizer and scheduler, and each step's gradient norm."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = build_optimizer(model, opt_cfg(lr=1e-2))
    sched = build_lr_scheduler(opt, sched_cfg(), total_steps=len(BATCHES))
    hooks = StepInBackward(opt, torch.device("cpu")) if early else None
    start = 0
    if resume is not None:  # after the hooks exist, as in train.py
        start, state = resume
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
    norms = []
    for x in BATCHES[start : start + steps]:
        model(x).square().sum().backward()
        if early:
            assert all(p.grad is None for p in model.parameters())  # freed as stepped
            norms.append(hooks.grad_norm().item())
        else:
            grads = [
                torch.linalg.vector_norm(p.grad, dtype=torch.float64) for p in model.parameters()
            ]
            norms.append(torch.linalg.vector_norm(torch.stack(grads)).item())
            opt.step()
            opt.zero_grad()
        sched.step()
    return model, opt, sched, norms


def test_step_in_backward_equals_the_step_after_backward():
    """The same AdamW update, bitwise (the fused kernel updates each parameter alone, whether
    shown one or its whole group), and the same gradient norm."""
    model, _, _, norms = _tiny_run(3, early=False)
    early_model, _, _, early_norms = _tiny_run(3, early=True)
    for a, b in zip(model.parameters(), early_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert early_norms == pytest.approx(norms, rel=1e-7)  # fp64 sums, returned in fp32


def test_step_in_backward_resumes_exactly():
    """load_state_dict replaces the optimizer's group dicts: the hooks must step with the
    restored groups, whose lr the scheduler keeps moving, not the ones they were built with."""
    whole, _, _, _ = _tiny_run(4, early=True)
    first, opt, sched, _ = _tiny_run(2, early=True)
    state = {"model": first.state_dict(), "optimizer": opt.state_dict(),
             "scheduler": sched.state_dict()}  # fmt: skip
    resumed, _, _, _ = _tiny_run(2, early=True, resume=(2, state))
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_adamw_groups_are_torchs_so_older_checkpoints_load():
    """DCP loads a group's every key by name: a key of titanlite's own in the saved groups would
    make checkpoints written before it fail to load (checked by hand: main's step-2 AdamW
    checkpoint resumes bitwise through step 4)."""
    model = torch.nn.Linear(2, 2)
    ours = build_optimizer(model, opt_cfg()).state_dict()["param_groups"]
    torchs = torch.optim.AdamW(model.parameters(), fused=True).state_dict()["param_groups"]
    assert all(g.keys() == torchs[0].keys() for g in ours)
