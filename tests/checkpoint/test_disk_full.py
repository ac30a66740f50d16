"""A disk that fills up during a save: the run warns before writing, stops with one line naming
the folder, what the checkpoint needs and what is free, removes the partial step and leaves the
earlier checkpoint loadable. On a real 100 MiB tmpfs (one debug checkpoint is ~64 MiB)."""

import subprocess

import pytest
import torch
from conftest import TINY_TRAIN
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import train


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=100m", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


# No thread dies printing a traceback (DCP's writer threads among them): the one line is all.
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_a_full_disk_stops_the_run_and_keeps_the_last_checkpoint(small_disk, tmp_path, capsys,
                                                                 async_mode):  # fmt: skip
    # All 6 blocks (the tiny run has 4): one checkpoint of ~64 MiB fits the 100 MiB, two do not.
    args = [*TINY_TRAIN, "--model.flavor", "debugmodel", "--training.steps", "6"]
    args += ["--checkpoint.enable", "--checkpoint.interval", "2"]
    args += ["--checkpoint.async_mode", async_mode]
    args += ["--job.dump_folder", str(small_disk)]
    assert train.main(args) == 5
    log = capsys.readouterr().out
    folder = small_disk / "checkpoint"
    warned = [ln for ln in log.splitlines() if "WARNING checkpoint step 4 needs about" in ln]
    assert warned and f"in {folder}, which has" in warned[0], log[-3000:]
    errors = [ln for ln in log.splitlines() if "ERROR checkpoint step 4 could not be written" in ln]
    assert len(errors) == 1, log[-3000:]
    assert f"written to {folder}: it needs about 6" in errors[0]  # ~64 MiB, the step-2 folder
    assert "MiB are free there (not enough space" in errors[0]
    assert "the partial step-4.tmp was removed; step 2 and earlier are untouched" in errors[0]
    assert "No space left on device" in errors[0]  # the first failed write, not what came after
    assert sorted(p.name for p in folder.iterdir()) == ["step-2"]
    state = tmp_path / "step2.pt"
    dcp_to_torch_save(folder / "step-2", state)  # every file there is whole and readable
    assert torch.load(state, weights_only=False)["model"]
