"""scripts/multinode_trainer.slurm on a real one-node SLURM cluster started on this machine:
a training job, then the time-limit warning (USR1 -> checkpoint -> requeue -> resume) and a
scheduler preemption with a grace period (SIGTERM -> checkpoint -> requeue -> resume), each
resumed run checked step by step against the uninterrupted one."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY_TRAIN, free_port, read_jsonl

from titanlite.checkpoint import scan_checkpoints
from titanlite.checkpoint.layout import MARKER

pytestmark = pytest.mark.slow  # every test here launches processes

NEEDED = ["slurmctld", "slurmd", "munged", "sbatch", "squeue", "scontrol", "scancel", "sinfo"]
_missing = [b for b in NEEDED if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]
if _missing:
    pytest.skip(
        f"SLURM is not installed (missing {', '.join(_missing)}); install with "
        "`apt-get install slurmctld slurmd slurm-client munge`",
        allow_module_level=True,
    )
if os.geteuid() != 0:
    pytest.skip("starting munged/slurmctld/slurmd needs root", allow_module_level=True)

SLURM_SCRIPTS = REPO / "scripts" / "slurm"
# One microbatch a rank on the job's 2 processes.
TINY = [*TINY_TRAIN, "--training.global_batch_size", "4", "--checkpoint.enable"]
STEPS = 20  # every run here trains this far, so the interrupted ones compare with the first
GRACE_S = 60  # GraceTime of the cluster's partition `preemptible`


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A one-node cluster with its own ports and state; always stopped, even on failure."""
    work = tmp_path_factory.mktemp("slurm")
    env = dict(
        os.environ,
        WORKDIR=str(work),
        SLURMCTLD_PORT=str(free_port()),
        SLURMD_PORT=str(free_port()),
        SLURM_CONF=str(work / "slurm.conf"),
        GRACE_TIME=str(GRACE_S),
    )
    start = subprocess.run(
        ["bash", str(SLURM_SCRIPTS / "start_cluster.sh")],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    try:
        if start.returncode != 0:
            logs = "".join(p.read_text() for p in (work / "log").glob("*.log"))
            pytest.fail(f"start_cluster.sh failed:\n{start.stdout}{start.stderr}\n{logs[-4000:]}")
        yield env
    finally:
        subprocess.run(["bash", str(SLURM_SCRIPTS / "stop_cluster.sh")], env=env, timeout=60)


def _submit(cluster, tmp_path, interval: int, partition: str = "debug") -> tuple[str, Path]:
    """sbatch the multinode script with 1 node x 2 CPU processes; returns (job id, dump folder)."""
    out = tmp_path / "out"
    (tmp_path / "logs").mkdir()
    env = dict(
        cluster,
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # the job finds torchrun
        TITANLITE_DIR=str(REPO),
        NPROC_PER_NODE="2",
        CONFIG_FILE="debug_model.toml",
        PORT=str(free_port()),
        TRAIN_ARGS=f"{' '.join(TINY)} --training.steps {STEPS} --checkpoint.interval {interval} "
        f"--checkpoint.stop_grace_seconds {GRACE_S} --job.dump_folder {out}",
    )
    script = str(REPO / "scripts" / "multinode_trainer.slurm")
    jid = subprocess.run(
        ["sbatch", "--nodes=1", "--parsable", f"--partition={partition}", script],
        cwd=tmp_path, env=env, check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    return jid, out


def _wait_gone(cluster, jid: str, tmp_path: Path, timeout: float = 240) -> str:
    """Wait until the job left the queue (a requeued job stays in it); return its log."""
    deadline = time.monotonic() + timeout
    while _squeue(cluster, jid):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", jid], env=cluster)
            pytest.fail(f"job {jid} still queued after {timeout} s:\n{_log(tmp_path, jid)}")
        time.sleep(0.5)
    return _log(tmp_path, jid)


def _wait_training(cluster, jid: str, out: Path, tmp_path: Path) -> None:
    """Wait until the job has logged its first step."""
    jsonl, deadline = out / "metrics.jsonl", time.monotonic() + 180
    while not (jsonl.exists() and jsonl.read_text().strip()):
        assert _squeue(cluster, jid) and time.monotonic() < deadline, _log(tmp_path, jid)
        time.sleep(0.2)


def _wait_log(tmp_path: Path, jid: str, text: str, timeout: float = 120) -> float:
    """Wait until the job's log holds `text`; return when (time.monotonic)."""
    deadline = time.monotonic() + timeout
    while text not in _log(tmp_path, jid):
        assert time.monotonic() < deadline, f"no {text!r} in:\n{_log(tmp_path, jid)[-4000:]}"
        time.sleep(0.2)
    return time.monotonic()


def _squeue(cluster, jid: str) -> str:
    return subprocess.run(
        ["squeue", "-h", "-j", jid], env=cluster, capture_output=True, text=True
    ).stdout.strip()


def _log(tmp_path: Path, jid: str) -> str:
    path = tmp_path / "logs" / f"titanlite-{jid}.out"
    return path.read_text() if path.exists() else f"(no {path})"


def _job_field(cluster, jid: str, key: str) -> str:
    info = subprocess.run(
        ["scontrol", "show", "job", jid], env=cluster, capture_output=True, text=True, check=True
    ).stdout
    return next(w.split("=", 1)[1] for w in info.split() if w.startswith(f"{key}="))


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(out / "metrics.jsonl")}


def _assert_resumed_without_loss(cluster, jid, out, log, uninterrupted) -> int:
    """The job ran twice and finished; the first run saved the step it was in, the second went on
    from it: every step once, with the uninterrupted run's loss. Returns the saved step."""
    assert _job_field(cluster, jid, "Restarts") == "1"
    assert _job_field(cluster, jid, "JobState") == "COMPLETED", log[-4000:]
    # The first run's ranks saved and exited on their own: torchrun never had to kill them.
    assert log.count("training step exited with") == 2 and "SIGKILL" not in log, log[-6000:]
    saved = sorted(scan_checkpoints(out / "checkpoint")[0])
    assert len(saved) == 2 and saved[1] == STEPS, saved  # the preemption save and the last step
    assert f"training from step {saved[0]} to {STEPS}" in log, log[-4000:]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == list(range(1, STEPS + 1))
    assert _losses(out) == _losses(uninterrupted), log[-6000:]  # bitwise
    return saved[0]


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory) -> Path:
    """The reference run: STEPS steps in one go; returns its dump folder."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    jid, out = _submit(cluster, tmp_path, interval=STEPS // 2)
    log = _wait_gone(cluster, jid, tmp_path)
    assert _job_field(cluster, jid, "JobState") == "COMPLETED", log[-4000:]
    assert _job_field(cluster, jid, "ExitCode") == "0:0", log[-4000:]
    assert "training step exited with 0" in log
    return out


def test_sbatch_trains_and_checkpoints(uninterrupted):
    assert [r["step"] for r in read_jsonl(uninterrupted / "metrics.jsonl")] == [
        *range(1, STEPS + 1)
    ]
    assert sorted(scan_checkpoints(uninterrupted / "checkpoint")[0]) == [STEPS // 2, STEPS]


def test_usr1_checkpoints_requeues_and_resumes(cluster, tmp_path, uninterrupted):
    jid, out = _submit(cluster, tmp_path, interval=1000)
    _wait_training(cluster, jid, out, tmp_path)
    # What slurm does at the time limit minus 120 s (--signal=B:USR1@120), now.
    subprocess.run(["scancel", "--batch", "--signal=USR1", jid], env=cluster, check=True)
    log = _wait_gone(cluster, jid, tmp_path)

    assert "requeueing job" in log and f"job {jid} run 2:" in log, log[-4000:]
    _assert_resumed_without_loss(cluster, jid, out, log, uninterrupted)


def test_preemption_with_grace_saves_requeues_and_resumes(cluster, tmp_path, uninterrupted):
    jid, out = _submit(cluster, tmp_path, interval=1000, partition="preemptible")
    _wait_training(cluster, jid, out, tmp_path)
    # A job of a higher partition needs the node: slurm sends SIGTERM to the job's step (every
    # torchrun, which forwards it to the ranks), and SIGKILL GraceTime seconds later.
    urgent = subprocess.run(
        ["sbatch", "--parsable", "--partition=urgent", "--exclusive", "--output=/dev/null",
         "--wrap=true"],
        env=cluster, check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    preempted = time.monotonic()
    signalled = _wait_log(tmp_path, jid, "Got signal 15")
    saved = _wait_log(tmp_path, jid, "stop requested by signal: saved step")
    exited = _wait_log(tmp_path, jid, "preempted by the scheduler: requeueing")
    requeued = _wait_log(tmp_path, jid, f"job {jid} run 2:")
    log = _wait_gone(cluster, jid, tmp_path)

    assert _job_field(cluster, urgent, "JobState") == "COMPLETED"
    assert f"job {jid} run 2:" in log, log[-4000:]
    assert exited - preempted < GRACE_S, log[-4000:]  # saved and gone before SIGKILL
    step = _assert_resumed_without_loss(cluster, jid, out, log, uninterrupted)
    save_s = json.loads((out / "checkpoint" / f"step-{step}" / MARKER).read_text())["save_seconds"]
    print(
        f"preemption: SIGTERM {signalled - preempted:.1f} s after the urgent job's submission; "
        f"step {step} saved (in {save_s} s) {saved - signalled:.1f} s after the SIGTERM, the "
        f"job's step gone {exited - signalled:.1f} s after it (grace {GRACE_S} s); the requeued "
        f"job started {requeued - exited:.1f} s later"
    )
