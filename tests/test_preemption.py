"""A preemption signal becomes this rank's stop vote; train.py makes the vote collective."""

import os
import signal

import pytest

from titanlite.preemption import SIGNALS, Preemption


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
