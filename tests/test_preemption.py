"""A preemption signal becomes this rank's stop vote; train.py makes the vote collective."""

import os
import signal

import pytest

from titanlite.preemption import (
    SIGNALS,
    Preemption,
    stop_grace_seconds,
    warn_if_slower_than_grace,
)


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_signal_sets_the_vote(sig):
    saved = {s: signal.getsignal(s) for s in SIGNALS}
    try:
        preemption = Preemption()
        preemption.install()
        assert not preemption.requested
        os.kill(os.getpid(), sig)
        assert preemption.requested
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@pytest.mark.parametrize(
    "configured, environ, version, expected",
    [
        (45.0, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "100"}, "2.13.0", 45.0),  # the scheduler's
        (0.0, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "100"}, "2.13.0", 100.0),  # torchrun reads it
        (0.0, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "100"}, "2.11.0", 30.0),  # torchrun ignores it
        (0.0, {}, "2.13.0", 30.0),
    ],
)
def test_stop_grace_seconds(configured, environ, version, expected):
    assert stop_grace_seconds(configured, environ, version) == expected


def test_a_save_slower_than_the_grace_warns(caplog):
    assert not warn_if_slower_than_grace(29.0, 30.0, "the save of step 4")
    assert not caplog.records
    assert warn_if_slower_than_grace(31.5, 30.0, "the save of step 4")
    (record,) = caplog.records
    assert record.levelname == "WARNING"
    assert record.getMessage().startswith("the save of step 4 took 31.5 s, more than the 30 s")
    assert "checkpoint.stop_grace_seconds" in record.getMessage()
