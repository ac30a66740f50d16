"""Checkpoint folders: only complete saves count, a killed save leaves the older ones intact,
and pruning keeps the newest `keep_latest_k` and the one just published."""

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

from titanlite.checkpoint import scan_checkpoints

WORKERS = Path(__file__).with_name("workers.py")


def test_keep_latest_k_and_load_step(tiny, tmp_path):
    mgr = tiny.manager(tmp_path, keep_latest_k=2)
    tiny.train(mgr, 4)
    complete, partial = scan_checkpoints(tmp_path / "checkpoint")
    assert sorted(complete) == [3, 4] and partial == []

    fresh = tiny.manager(tmp_path, load_step=3)
    assert tiny.resume(fresh) == 3
    assert fresh.train_state.step == 3 and fresh.dataloader.pos == 12

    with pytest.raises(ValueError, match=r"load_step=1: no complete checkpoint .*step-1.*\[3, 4\]"):
        tiny.resume(tiny.manager(tmp_path, load_step=1))


def test_prune_keeps_the_checkpoint_just_published(tiny, tmp_path):
    mgr = tiny.manager(tmp_path)
    tiny.train(mgr, 4)
    mgr.close()
    # A rerun from step 1 saves step 2 again: the newest two by step are 3 and 4, but the new
    # step 2 is this run's only checkpoint after its start.
    rerun = tiny.manager(tmp_path, load_step=1, keep_latest_k=2)
    assert tiny.resume(rerun) == 1
    tiny.train(rerun, 1)
    assert sorted(scan_checkpoints(tmp_path / "checkpoint")[0]) == [2, 3, 4]


@pytest.mark.slow
def test_sigkill_during_save_keeps_the_previous_checkpoint(tiny, tmp_path, caplog):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, str(WORKERS), "slow_save", str(tmp_path)], env=env)
    try:
        for _ in range(1200):
            if (tmp_path / "writing").exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert (tmp_path / "writing").exists(), f"child exited {proc.returncode} before writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert any((tmp_path / "checkpoint" / "step-2.tmp").glob("*.distcp"))
    mgr = tiny.manager(tmp_path)
    with caplog.at_level(logging.WARNING, logger="titanlite.checkpoint"):
        assert tiny.resume(mgr) == 1
    assert "partial checkpoint" in caplog.text and "step-2.tmp" in caplog.text
    assert mgr.dataloader.pos == 4
