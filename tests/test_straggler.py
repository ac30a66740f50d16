"""SlowRankFinder's arithmetic on given per-rank figures (the gather itself runs under torchrun in
tests/integration/test_slow_rank.py)."""

import logging

import pytest
import torch

from titanlite.straggler import SlowRankFinder, local_numel


def finder(figures: list, **kwargs) -> SlowRankFinder:
    """A finder for len(figures[0]) ranks whose gathers return each of `figures` in turn."""
    world = len(figures[0])
    f = SlowRankFinder(world, torch.device("cpu"), kwargs.pop("threshold_pct", 10.0),
                       kwargs.pop("patience", 2), numel=1000, **kwargs)  # fmt: skip
    rounds = iter(figures)
    f.gather = lambda data_s, optimizer_s: torch.tensor(next(rounds), dtype=torch.float64)
    f.host_names = lambda: [f"node{r}" for r in range(world)]
    return f


def test_one_rank_reports_nothing():
    assert SlowRankFinder(1, torch.device("cpu"), 10.0, 3, 1000).report(1.0, 0.1, 0.01) == {}


def test_the_lag_is_data_plus_optimizer_time_over_the_median_rank():
    # 4 ranks: data seconds, optimizer seconds per element (x 1000 elements each).
    figures = [[0.10, 1e-5], [0.10, 1e-5], [0.30, 1e-5], [0.10, 5e-5]]
    out = finder([figures]).report(2.0, 0.1, 0.01)
    # rank 2: 0.2 s of data; rank 3: 0.04 s of optimizer over the median's 0.01 s.
    assert out == {
        "slow_rank": 2,
        "slow_rank_lag_pct": pytest.approx(10.0),
        "slow_rank_data_lag_pct": pytest.approx(10.0),
    }
    figures[3][1] = 3e-4  # now rank 3's optimizer lags 0.29 s
    out = finder([figures]).report(2.0, 0.1, 0.01)
    assert out["slow_rank"] == 3 and out["slow_rank_data_lag_pct"] == 0.0
    assert out["slow_rank_lag_pct"] == pytest.approx(14.5)


def test_without_optimizer_times_only_data_counts():
    # NaN: the optimizer stepped in backward, untimed; rank 1's NaN must not hide rank 0's data.
    figures = [[0.5, float("nan")], [0.1, float("nan")], [0.1, float("nan")]]
    out = finder([figures]).report(1.0, 0.1, None)
    assert out["slow_rank"] == 0 and out["slow_rank_lag_pct"] == pytest.approx(40.0)


def test_the_warning_comes_once_after_patience_log_steps_in_a_row(caplog):
    slow1 = [[0.1, 1e-5], [0.5, 1e-5], [0.1, 1e-5]]
    calm = [[0.1, 1e-5], [0.1, 1e-5], [0.1, 1e-5]]
    slow2 = [[0.1, 1e-5], [0.1, 1e-5], [0.1, 1e-3]]
    # a streak broken by a calm step and by another rank, then 3 in a row: one warning.
    rounds = [slow1, calm, slow1, slow2, slow1, slow1, slow1]
    f = finder(rounds, patience=3)
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        for _ in rounds:
            f.report(1.0, 0.1, 0.01)
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "rank 1 on host node1 has been the slowest on 3 log steps in a row, 40% of a step behind "
        "the median rank (mostly data): check that host's storage and data workers"
    ]


def test_only_the_log_rank_warns_and_zero_threshold_never_does(caplog):
    slow = [[0.1, 1e-5], [0.1, 1e-3]]
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        for kwargs in (dict(warns=False), dict(threshold_pct=0.0)):
            f = finder([slow] * 3, patience=2, **kwargs)
            for _ in range(3):
                assert f.report(1.0, 0.1, 0.01)["slow_rank"] == 1
    assert caplog.records == []


def test_local_numel_counts_this_ranks_elements():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))
    assert local_numel(model) == 4 * 3 + 3 + 3 * 2
