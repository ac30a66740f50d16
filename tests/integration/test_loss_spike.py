"""The loss spike guard in real runs: a batch of random tokens injected on every rank at step 7,
after six steps on short repetitive documents whose loss falls fast, is reported with the data
position of the step and, with on_loss_spike skip, not stepped into on any rank."""

import pickle
import re

import pytest
import torch
from conftest import REPO, read_jsonl, torchrun_script
from integration.parity import masked_runs
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

pytestmark = pytest.mark.slow  # launches processes

GUARD = ["--training.loss_spike_factor", "2", "--training.loss_spike_window", "3"]
# Step 7 (0-based 6) of a global batch of 8: data order positions 48-55.
REPORT = re.compile(
    r"loss spike at step (\d+): loss (\S+) is (\S+)x the mean of the last 3 steps; it trained "
    r"on data order positions \[48, 56\) \(epoch \d+\): token cache samples [\d, ]+; the "
    r"optimizer step was (\w+)"
)


def model_state(step_dir, tmp_path):
    out = tmp_path / f"{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, out)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("action, nproc", [("skip", 2), ("report", 1)])
def test_a_corrupt_batch_is_reported_and_skipped_on_every_rank(tmp_path, action, nproc):
    # All 6 blocks: with the tiny run's 4 the junk batch's loss was not twice step 4's (7.0, 4.2).
    args = [*masked_runs(tmp_path, "debugmodel")[1], "--training.steps", "7", *GUARD]
    args += ["--training.on_loss_spike", action, "--checkpoint.enable"]
    args += ["--checkpoint.interval", "6", "--job.dump_folder", str(tmp_path / "run")]
    proc = torchrun_script(REPO / "scripts" / "fault_inject.py", "junk", "7", *args,
                           nproc=nproc)  # fmt: skip
    log = proc.stdout + proc.stderr
    spikes = REPORT.findall(log)
    assert spikes and {s[0] for s in spikes} == {"7"}, log[-3000:]
    assert all(float(ratio) > 2 for _, _, ratio, _ in spikes)
    assert {taken for *_, taken in spikes} == {"skipped" if action == "skip" else "taken"}
    losses = [r["loss"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert losses[6] > 2 * max(losses[3:6]), losses  # the junk batch's loss, as logged
    ckpt = tmp_path / "run" / "checkpoint"
    before, after = (model_state(ckpt / f"step-{s}", tmp_path) for s in (6, 7))
    same = all(torch.equal(before["model"][k], after["model"][k]) for k in before["model"])
    # Skipped: no rank changed its shard of the weights (the saved whole model is bitwise the
    # step-6 one) and the spike's loss is left out of the mean the next steps are judged by.
    assert same == (action == "skip")
    state = pickle.loads(after["train_state"])
    assert state["skipped_steps"] == (action == "skip")
    assert state["recent_losses"] == pytest.approx(losses[3:6], rel=1e-6)
