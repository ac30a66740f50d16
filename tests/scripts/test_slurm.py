"""scripts/multinode_trainer.slurm on a real one-node SLURM cluster started on this machine:
a training job, then preemption (USR1 -> checkpoint -> requeue -> resume)."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY_TRAIN, free_port, read_jsonl

from titanlite.checkpoint import scan_checkpoints

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


def _submit(cluster, tmp_path, steps: int, interval: int) -> tuple[str, Path]:
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
        TRAIN_ARGS=f"{' '.join(TINY)} --training.steps {steps} --checkpoint.interval {interval} "
        f"--job.dump_folder {out}",
    )
    jid = subprocess.run(
        ["sbatch", "--nodes=1", "--parsable", str(REPO / "scripts" / "multinode_trainer.slurm")],
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


def test_sbatch_trains_and_checkpoints(cluster, tmp_path):
    jid, out = _submit(cluster, tmp_path, steps=4, interval=2)
    log = _wait_gone(cluster, jid, tmp_path)
    assert _job_field(cluster, jid, "JobState") == "COMPLETED", log[-4000:]
    assert _job_field(cluster, jid, "ExitCode") == "0:0", log[-4000:]
    assert "training step exited with 0" in log
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4]
    assert sorted(scan_checkpoints(out / "checkpoint")[0]) == [2, 4]


def test_usr1_checkpoints_requeues_and_resumes(cluster, tmp_path):
    steps = 20
    jid, out = _submit(cluster, tmp_path, steps=steps, interval=1000)
    jsonl = out / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (jsonl.exists() and jsonl.read_text().strip()):
        assert _squeue(cluster, jid) and time.monotonic() < deadline, _log(tmp_path, jid)
        time.sleep(0.2)
    # What slurm does at the time limit minus 120 s (--signal=B:USR1@120), now.
    subprocess.run(["scancel", "--batch", "--signal=USR1", jid], env=cluster, check=True)
    log = _wait_gone(cluster, jid, tmp_path)

    assert "requeueing job" in log and f"job {jid} run 2:" in log, log[-4000:]
    assert _job_field(cluster, jid, "Restarts") == "1"
    assert _job_field(cluster, jid, "JobState") == "COMPLETED", log[-4000:]
    saved = sorted(scan_checkpoints(out / "checkpoint")[0])
    assert len(saved) == 2 and saved[1] == steps, saved  # the preemption save and the last step
    assert f"training from step {saved[0]} to {steps}" in log, log[-4000:]
    # Each step exactly once: the first run stopped at the saved step, the second went on from it.
    assert [r["step"] for r in read_jsonl(jsonl)] == list(range(1, steps + 1)), log[-6000:]
