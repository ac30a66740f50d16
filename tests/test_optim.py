import math
from types import SimpleNamespace

import pytest
import torch

from titanlite.optim import build_lr_scheduler, build_optimizer


def sched_cfg(**kw):
    base = dict(warmup_steps=4, decay_ratio=-1.0, decay_type="linear", min_lr_factor=0.0)
    return SimpleNamespace(**{**base, **kw})


def opt_cfg(**kw):
    base = dict(
        name="AdamW", lr=1.0, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
        implementation="foreach",
    )  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


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


def test_warmup_then_linear_decay_to_zero():
    lr = lrs({}, total=10)
    assert lr[:4] == pytest.approx([1 / 5, 2 / 5, 3 / 5, 4 / 5])
    assert lr[4] == pytest.approx(1.0)
    assert lr[9] == pytest.approx(1 - 5 / 6)  # still decaying at the last step: never 0 early
    assert all(a > b for a, b in zip(lr[4:], lr[5:]))


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
