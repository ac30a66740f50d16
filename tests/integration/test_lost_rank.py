"""A rank that hangs or dies stops every rank in bounded time: after the first step collectives
time out after comm.train_timeout_seconds (torch's default is 30 minutes), and the rank that
sees the failure exits with one line naming the step (exit code 4), not a traceback."""

import pytest
from conftest import REPO, TINY_TRAIN, read_jsonl, torchrun_script

pytestmark = pytest.mark.slow  # launches processes


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_lost_rank_stops_the_job_naming_the_step(tmp_path, how):
    args = [*TINY_TRAIN, "--training.steps", "6", "--comm.train_timeout_seconds", "5"]
    args += ["--job.dump_folder", str(tmp_path)]
    # The harness's own limit: without the train timeout a stopped peer would hold rank 0 in
    # its collective for torch's 30 minutes.
    proc = torchrun_script(REPO / "scripts" / "fault_inject.py", how, "3", *args,
                           nproc=2, timeout=120, check=False)  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 4, log[-3000:]
    errors = [ln for ln in log.splitlines() if "a collective failed" in ln]
    assert errors, log[-3000:]
    assert "step 3: a collective failed, a rank died or hangs (the timeout is 5 s" in errors[0]
    sign = "Timed out waiting 5000ms" if how == "stop" else "Connection"
    assert sign in errors[0], errors
    assert "Traceback" not in log
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
