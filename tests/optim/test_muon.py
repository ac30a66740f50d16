"""One process: the Muon recipe is torch.optim.Muon on the hidden matrices and torch's AdamW on
the rest, bitwise, with every group driven by the LR schedule."""

import pytest
import torch

from titanlite.config import LRScheduler, Optimizer
from titanlite.optim import build_lr_scheduler, build_optimizer, state_bytes


class Tiny(torch.nn.Module):
    """Every kind: an embedding, a norm, hidden matrices (one tall, one wide), a bias, output."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(16, 8)
        self.norm = torch.nn.RMSNorm(8)
        self.up = torch.nn.Linear(8, 24)
        self.down = torch.nn.Linear(24, 8, bias=False)
        self.output = torch.nn.Linear(8, 16, bias=False)

    def forward(self, x):
        return self.output(self.down(torch.relu(self.up(self.norm(self.tok_embeddings(x))))))


TOKENS = torch.randint(0, 16, (4, 3, 6), generator=torch.Generator().manual_seed(0))


def _steps(opt, model, sched=None):
    for x in TOKENS[:3]:
        model(x).logsumexp(-1).sum().backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_muon_recipe_equals_torch_muon_and_adamw(adjust):
    torch.manual_seed(0)
    ours, ref = Tiny(), Tiny()
    ref.load_state_dict(ours.state_dict())
    cfg = Optimizer(name="Muon", lr=1e-2, muon_lr=2e-2, muon_adjust_lr=adjust, weight_decay=0.1)
    opt = build_optimizer(ours, cfg)

    matrices = [ref.up.weight, ref.down.weight]
    decayed = [ref.tok_embeddings.weight, ref.output.weight]
    plain = [ref.norm.weight, ref.up.bias]
    muon = torch.optim.Muon(matrices, lr=2e-2, weight_decay=0.1, adjust_lr_fn=adjust)
    adamw = torch.optim.AdamW(
        [{"params": decayed}, {"params": plain, "weight_decay": 0.0}],
        lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True,
    )  # fmt: skip
    for x in TOKENS[:3]:
        ref(x).logsumexp(-1).sum().backward()
        muon.step()
        adamw.step()
        ref.zero_grad()
    _steps(opt, ours)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert {opt.optimizer_of(g) for g in opt.param_groups} == {"Muon", "AdamW"}
    # One momentum buffer per matrix, two moments (and the step) elsewhere.
    assert opt.state[ours.up.weight].keys() == {"momentum_buffer"}
    assert opt.state[ours.norm.weight].keys() == {"step", "exp_avg", "exp_avg_sq"}


def test_the_schedule_drives_every_group():
    model = Tiny()
    cfg = Optimizer(name="Muon", lr=1e-2, muon_lr=4e-2, groups=["kind=norm lr=1e-3"])
    opt = build_optimizer(model, cfg)
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=8), total_steps=16)
    _steps(opt, model, sched)
    peaks = sorted({g["initial_lr"] for g in opt.param_groups})
    assert peaks == [1e-3, 1e-2, 4e-2]
    for g in opt.param_groups:  # the 4th step of an 8-step warmup
        assert g["lr"] == pytest.approx(g["initial_lr"] * 4 / 8)


def test_adam_is_torch_adam_with_coupled_decay():
    torch.manual_seed(0)
    ours, ref = Tiny(), Tiny()
    ref.load_state_dict(ours.state_dict())
    opt = build_optimizer(ours, Optimizer(name="Adam", lr=1e-2, weight_decay=0.0))
    assert set(opt.inner) == {"Adam"} and type(opt.inner["Adam"]) is torch.optim.Adam
    adam = torch.optim.Adam(ref.parameters(), lr=1e-2, betas=(0.9, 0.95), fused=True)
    for x in TOKENS[:3]:
        ref(x).logsumexp(-1).sum().backward()
        adam.step()
        ref.zero_grad()
    _steps(opt, ours)
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_state_dict_round_trip_resumes_bitwise():
    """torch's state_dict of the grouped optimizer, loaded into a fresh one: the next steps are
    the uninterrupted run's, bit for bit (the DCP path: tests/optim/test_muon_checkpoint.py)."""
    assert_resume_is_bitwise(Optimizer(name="Muon", lr=1e-2))


def assert_resume_is_bitwise(cfg: Optimizer) -> torch.optim.Optimizer:
    """Twice _steps uninterrupted, and once then again with a fresh optimizer of `cfg` given the
    first one's state_dict, end on the same weights, bit for bit. Returns the resumed optimizer."""
    torch.manual_seed(0)
    whole, half = Tiny(), Tiny()
    half.load_state_dict(whole.state_dict())
    opt = build_optimizer(whole, cfg)
    _steps(opt, whole)
    _steps(opt, whole)
    first = build_optimizer(half, cfg)
    _steps(first, half)
    resumed = build_optimizer(half, cfg)
    resumed.load_state_dict(first.state_dict())
    _steps(resumed, half)
    for a, b in zip(whole.parameters(), half.parameters(), strict=True):
        assert torch.equal(a, b)
    return resumed


def test_state_bytes_before_the_first_step_are_those_after_it():
    """What the dry run reports as the checkpoint's optimizer part: one buffer per Muon
    element, two moments per AdamW one (AdamW's step counters, scalars, aside)."""
    model = Tiny()
    opt = build_optimizer(model, Optimizer(name="Muon"))
    predicted = state_bytes(opt)
    matrices, rest = 24 * 8 + 8 * 24, 16 * 8 + 16 * 8 + 8 + 24  # up, down; the others
    assert predicted == 4 * (matrices + 2 * rest)
    _steps(opt, model)
    tensors = [t for s in opt.state.values() for k, t in s.items() if k != "step"]
    assert predicted == sum(t.numel() * t.element_size() for t in tensors)
