"""The slow rank is found: two gloo ranks, rank 1 slowed on purpose in its data loading or its
compute; the log names it, its lag and the cause, and warns with its host name."""

import socket

import pytest
from conftest import REPO, TINY_TRAIN, read_jsonl, torchrun_script


@pytest.mark.parametrize("what", ["data", "compute"])
def test_a_deliberately_slowed_rank_is_named_with_its_cause_and_host(tmp_path, what):
    args = [*TINY_TRAIN, "--job.dump_folder", tmp_path, "--training.steps", "5",
            "--metrics.slow_rank_patience", "3"]  # fmt: skip
    proc = torchrun_script(REPO / "tests" / "integration" / "slowed_rank.py", what, *args, nproc=2)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["slow_rank"] for r in records] == [1] * 5
    # Step 1 is left out of the figures: its one-off costs (the optimizer's lazy state, the
    # allocator's first buffers) differ between ranks by tens of ms and make it a longer step.
    # After it, 0.6 s in a step of 1-3 s (2 cores under the rest of the suite) is far over the
    # 10% threshold, and the other rank-to-rank noise (up to ~40 ms seen) is far under the cause.
    later = records[1:]
    assert all(r["slow_rank_lag_pct"] > 10 for r in later), later
    data_share = [r["slow_rank_data_lag_pct"] / r["slow_rank_lag_pct"] for r in later]
    if what == "data":
        assert all(share > 0.8 for share in data_share), data_share
    else:
        assert all(share < 0.2 for share in data_share), data_share
    log = proc.stdout + proc.stderr
    warning = f"rank 1 on host {socket.gethostname()} has been the slowest on 3 log steps in a row"
    assert log.count(warning) == 1, log[-3000:]
    assert f"(mostly {what})" in log
    assert "slow rank 1 +" in log  # the console line
