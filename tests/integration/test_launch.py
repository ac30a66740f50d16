"""Launching: two torchrun "nodes" on one machine, elastic restart after a killed rank,
shellcheck on every shell script, the launchers' allocator setting."""

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from agents import agent_env, finish, last_losses, torchrun, workers
from conftest import REPO, TINY_TRAIN, free_port, train_many

pytestmark = pytest.mark.slow  # every test here launches processes

TINY = [*TINY_TRAIN, "--training.global_batch_size", "4"]  # one microbatch a rank on 2 or 4 ranks


def test_two_nodes_match_one_node(tmp_path):
    """2 agents x 2 workers with c10d rendezvous == 4 workers on one node, FSDP 2 x TP 2. The
    one-node reference is forked from the test's warm process (train_many): only the two nodes
    need torchrun's agents, and the reference spares five interpreters' start-up."""
    args = [*TINY, "--parallelism.tensor_parallel_degree", "2", "--training.steps", "4"]
    one = tmp_path / "one"
    train_many([[*args, "--job.dump_folder", str(one)]], nproc=4)

    two = tmp_path / "two"
    rdzv = ["--nnodes", "2", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
            "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "--rdzv_id", "two-nodes"]  # fmt: skip
    cmd = torchrun(rdzv, [*args, "--job.dump_folder", str(two)])
    nodes = [
        subprocess.Popen(
            cmd,
            cwd=REPO,
            env=agent_env(),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for _ in range(2)
    ]
    for node in nodes:
        finish(node)
    a, b = last_losses(one), last_losses(two)
    assert sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step


@pytest.mark.skipif(shutil.which("pgrep") is None, reason="needs pgrep (procps) to find workers")
def test_killed_rank_restarts_and_resumes_exactly(tmp_path):
    """SIGKILL one worker mid-run: torchrun restarts the group, which resumes from the newest
    checkpoint and logs the same losses as an uninterrupted run (forked, as in the test above)."""
    args = [*TINY, "--training.steps", "8", "--checkpoint.enable", "--checkpoint.interval", "2"]
    straight = tmp_path / "straight"
    train_many([[*args, "--job.dump_folder", str(straight)]], nproc=2)

    out = tmp_path / "elastic"
    # 3, not 1: on a loaded machine a restarted group's gloo connect is sometimes refused once.
    launch = ["--standalone", "--nproc_per_node", "2", "--max-restarts", "3"]
    cmd = torchrun(launch, [*args, "--job.dump_folder", str(out)])
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=agent_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    jsonl = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (jsonl.exists() and max(last_losses(out), default=0) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, "no step 3 logged"
        time.sleep(0.05)
    victim = workers(proc.pid)[-1]
    os.kill(victim, signal.SIGKILL)
    log = finish(proc)

    starts = [line for line in log.splitlines() if "training from step" in line]
    assert len(starts) >= 2, log[-4000:]  # the first run and the restarted one(s)
    resumed = int(starts[-1].split("training from step")[1].split()[0])
    assert resumed >= 2, starts
    a, b = last_losses(straight), last_losses(out)
    assert sorted(b) == list(range(1, 9))
    assert [b[s] for s in range(resumed + 1, 9)] == [a[s] for s in range(resumed + 1, 9)]


def _shell_scripts() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    scripts = {REPO / p for p in listed if p.endswith((".sh", ".slurm"))}
    scripts |= {REPO / p for p in listed if _has_shell_shebang(REPO / p)}
    return sorted(p for p in scripts if p.is_file())


def _has_shell_shebang(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        first = f.readline(100)
    return first.startswith(b"#!") and (b"bash" in first or first.rstrip().endswith(b"/sh"))


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck_passes_on_every_shell_script():
    scripts = _shell_scripts()
    assert REPO / "scripts" / "multinode_trainer.slurm" in scripts
    proc = subprocess.run(
        ["shellcheck", "--shell=bash", *map(str, scripts)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _fake_bin(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


# What the launcher hands torchrun, as the fake torchrun / srun below print it.
_ALLOC_ENV = 'echo "alloc=${PYTORCH_CUDA_ALLOC_CONF-unset} generic=${PYTORCH_ALLOC_CONF-unset}"'


def _launch_env(tmp_path: Path, script: str, user: dict) -> str:
    """Runs `script` with fake torchrun (and SLURM commands) that print the allocator settings."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_bin(bin_dir, "torchrun", _ALLOC_ENV)
    _fake_bin(bin_dir, "scontrol", "echo node1")
    # srun runs twice: `hostname --ip-address` on the head node, then the training step.
    srun = f'case "$*" in *--ip-address*) echo 127.0.0.1;; *) {_ALLOC_ENV};; esac'
    _fake_bin(bin_dir, "srun", srun)
    env = {k: v for k, v in os.environ.items() if not k.endswith("ALLOC_CONF")}
    env.update(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        NGPU="1",
        NPROC_PER_NODE="1",
        SLURM_JOB_NODELIST="node1",
        SLURM_JOB_ID="1",
        SLURM_NNODES="1",
        **user,
    )
    proc = subprocess.run(
        ["bash", str(REPO / script)], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return next(line for line in proc.stdout.splitlines() if line.startswith("alloc="))


@pytest.mark.parametrize("script", ["run_llama_train.sh", "scripts/multinode_trainer.slurm"])
@pytest.mark.parametrize(
    "user, expected",
    [
        ({}, "alloc=expandable_segments:True generic=unset"),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, "alloc=max_split_size_mb:512"),
        ({"PYTORCH_CUDA_ALLOC_CONF": ""}, "alloc= generic=unset"),  # empty: torch's default
        ({"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}, "alloc=unset"),
    ],
)
def test_launchers_default_to_expandable_segments_and_keep_the_users(
    tmp_path, script, user, expected
):
    assert _launch_env(tmp_path, script, user).startswith(expected)
