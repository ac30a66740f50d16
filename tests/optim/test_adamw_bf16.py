"""optimizer.state_dtype bfloat16: AdamW's arithmetic over moments rounded to bf16 each step."""

import pytest
import torch
from optim.test_muon import TOKENS, Tiny, _steps, assert_resume_is_bitwise

from titanlite.checks import check_options
from titanlite.config import ConfigError, Optimizer
from titanlite.config_parse import parse_args
from titanlite.optim import build_optimizer, state_bytes

BF16 = Optimizer(name="AdamW", lr=1e-2, state_dtype="bfloat16")


def test_torch_adamw_with_its_moments_rounded_to_bf16_each_step():
    torch.manual_seed(0)
    ours, ref = Tiny(), Tiny()
    ref.load_state_dict(ours.state_dict())
    opt = build_optimizer(ours, BF16)
    decayed = [p for p in ref.parameters() if p.ndim == 2]
    plain = [p for p in ref.parameters() if p.ndim < 2]
    adamw = torch.optim.AdamW(
        [{"params": decayed}, {"params": plain, "weight_decay": 0.0}],
        lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False,
    )  # fmt: skip
    for x in TOKENS[:3]:
        ref(x).logsumexp(-1).sum().backward()
        adamw.step()
        ref.zero_grad()
        for state in adamw.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                state[key].copy_(state[key].bfloat16())
    _steps(opt, ours)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    assert {t.dtype for s in opt.state.values() for k, t in s.items() if k != "step"} == {
        torch.bfloat16
    }
    fp32 = build_optimizer(ours, Optimizer(name="AdamW"))
    assert state_bytes(opt) * 2 == state_bytes(fp32)


def test_bf16_states_resume_bitwise_and_stay_bf16():
    resumed = assert_resume_is_bitwise(BF16)
    moments = [t for s in resumed.state.values() for k, t in s.items() if k.startswith("exp_avg")]
    assert moments and {t.dtype for t in moments} == {torch.bfloat16}


def test_bf16_states_need_an_adamw_parameter():
    with pytest.raises(ConfigError, match="no parameter is AdamW's"):
        check_options(
            parse_args(["--optimizer.name", "Adam", "--optimizer.state_dtype", "bfloat16"])
        )
    check_options(parse_args(["--optimizer.name", "Muon", "--optimizer.state_dtype", "bfloat16"]))
