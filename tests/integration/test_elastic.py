"""A world that shrinks and grows through torchrun's elastic range (`--nnodes 1:2`): a node of 2
ranks dies mid-run, the other re-forms the job alone and resumes from the newest checkpoint
(4 ranks -> 2); a node joins again, and the job grows back (2 -> 4), resuming from a checkpoint
the 2 ranks wrote. From a prepared token store, every sample the steps trained on is recorded
(debug.log_sample_ids): across both changes each step keeps its samples, each sample once, and
the losses stay those of one process."""

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
from agents import agent_env, finish, kill_node, torchrun
from conftest import REPO, TINY_TRAIN, free_port, read_jsonl

import train
from titanlite.config_parse import parse_args
from titanlite.data.sources import local_source
from titanlite.data.store_build import build_store
from titanlite.data.tokenizer import build_tokenizer

pytestmark = pytest.mark.slow  # launches processes

STEPS = 30  # the 2-rank group must still have steps to train when the node joins again
ARGS = [*TINY_TRAIN, "--training.steps", str(STEPS), "--debug.log_sample_ids"]
# Seconds, not torch's defaults (30 s last call, 15 s to declare a node dead): the surviving node
# re-forms the job as soon as the dead one's heartbeats lapse. A heartbeat is refreshed every 1-2
# intervals, so 4 missed intervals, not fewer, tell a dead node from a busy one.
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=4"
# A fresh store per group (rank 0 hosts it): see titanlite.distributed.store_namespace.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# An agent imported ahead and started on a line of input: the join then lands within a
# second, while the 2-rank job still has steps to train on a loaded machine.
HELD_AGENT = "import sys, torch.distributed.run as run; sys.stdin.readline(); run.main()"


def _prepared_store(tmp_path: Path) -> Path:
    """What scripts/prepare_data.py writes, from 100 small documents (~300 samples of 33
    tokens), built in this process."""
    corpus = tmp_path / "corpus.jsonl"
    words = ["alpha", "beta", "gamma", "delta", "pi", "x", "return", "def", "(", ")"]
    with open(corpus, "w") as f:
        for i in range(100):
            text = f"doc {i} " + " ".join(words[(i * j) % len(words)] for j in range(40 + i))
            f.write(json.dumps({"text": text}) + "\n")
    out = tmp_path / "store"
    build_store(local_source(str(corpus)), build_tokenizer(parse_args(ARGS).model), out)
    return out


def _records(folder: Path, name: str) -> list[dict]:
    path = folder / name
    return read_jsonl(path) if path.exists() else []


def _worlds(folder: Path) -> list[int]:
    """The world size of each group that trained a step, in order: each logs it with its first
    step."""
    return [int(r["world_size"]) for r in _records(folder, "metrics.jsonl") if "world_size" in r]


def _wait_for(what: str, done, agent: subprocess.Popen, deadline: float) -> None:
    while not done():
        assert agent.poll() is None, f"the agent exited ({agent.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} in time"
        time.sleep(0.05)


def _last_by_step(records: list[dict]) -> dict[int, dict]:
    """Each step's last record: a step redone after a restart counts as its redo."""
    return {r["step"]: r for r in records}


def test_a_node_leaves_and_joins_again_through_the_elastic_range(tmp_path):
    store = _prepared_store(tmp_path)
    args = [*ARGS, "--training.dataset_path", str(store)]
    out = tmp_path / "elastic"
    port, logs = free_port(), []

    def agent(host: bool, held: bool = False) -> subprocess.Popen:
        launch = [
            "--nnodes", "1:2", "--nproc_per_node", "2", "--max-restarts", "3",
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
            "--rdzv_id", "elastic", "--rdzv_conf", f"{RDZV_CONF},is_host={int(host)}",
        ]  # fmt: skip
        cmd = torchrun(launch, [
            *args, "--job.dump_folder", str(out), "--checkpoint.enable",
            "--checkpoint.interval", "2", "--comm.train_timeout_seconds", "10",
        ])  # fmt: skip
        if held:
            cmd[1:3] = ["-c", HELD_AGENT]
        logs.append(tmp_path / f"agent-{len(logs)}.log")
        with open(logs[-1], "w") as log:  # the agent writes to its own copy
            return subprocess.Popen(
                cmd, cwd=REPO, env=agent_env(**ELASTIC_ENV), text=True,
                stdin=subprocess.PIPE if held else subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip

    # The first agent hosts the rendezvous: the node that dies must not be the one holding it.
    first, second = agent(host=True), agent(host=False)
    joining = None
    deadline = time.monotonic() + 240
    try:
        steps = lambda: [r["step"] for r in _records(out, "metrics.jsonl")]  # noqa: E731
        _wait_for("step 3 on 4 ranks", lambda: max(steps(), default=0) >= 3, first, deadline)
        kill_node(second)
        killed = time.monotonic()
        joining = agent(host=False, held=True)
        _wait_for("a step on 2 ranks", lambda: _worlds(out)[-1:] == [2], first, deadline)
        shrunk = time.monotonic()
        joining.stdin.write("go\n")
        joining.stdin.flush()
        _wait_for("a step on 4 ranks again", lambda: _worlds(out)[-1:] == [4], first, deadline)
        grown = time.monotonic()
        log = finish(first, log=logs[0])
        finish(joining, log=logs[2])
    finally:
        for proc in (first, second, joining):
            if proc is not None and proc.poll() is None:
                kill_node(proc)
    print(f"4 -> 2 ranks: training {shrunk - killed:.1f} s after the kill; 2 -> 4: training "
          f"{grown - shrunk:.1f} s after the join")  # fmt: skip

    assert _worlds(out) == [4, 2, 4]
    starts = [int(line.split("training from step")[1].split()[0])
              for line in log.splitlines() if "training from step" in line]  # fmt: skip
    # As a set: a group's start may be retried (a gloo connect refused once on a loaded machine).
    first_steps = sorted(set(starts))
    assert len(first_steps) == 3 and first_steps[0] == 0, starts
    assert 2 <= first_steps[1] < first_steps[2] < STEPS, starts
    assert "Data loader position carries over from dp degree 4 to 2" in log
    assert "Data loader position carries over from dp degree 2 to 4" in log

    one = tmp_path / "one"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the launched ranks (OMP_NUM_THREADS=1): no spinning on a busy CPU
    try:
        assert train.main([*args, "--job.dump_folder", str(one)]) == 0
    finally:
        torch.set_num_threads(threads)
    ref = {r["step"]: r["samples"] for r in _records(one, "sample_ids.jsonl")}
    logged = _records(out, "sample_ids.jsonl")
    samples = {step: r["samples"] for step, r in _last_by_step(logged).items()}
    assert samples == ref  # every step trained on the uninterrupted run's samples
    trained = [s for step in range(1, STEPS + 1) for s in samples[step]]
    assert len(trained) == len(set(trained)) == STEPS * 8  # the epoch's first STEPS x 8, each once
    assert all(r["samples"] == ref[r["step"]] for r in logged)  # redone steps: the same data
    assert len(logged) > STEPS  # some steps were redone

    losses = _last_by_step(_records(out, "metrics.jsonl"))
    ref_losses = _last_by_step(read_jsonl(one / "metrics.jsonl"))
    rel = {s: abs(losses[s]["loss"] - r["loss"]) / r["loss"] for s, r in ref_losses.items()}
    print(f"loss vs one process: max relative deviation {max(rel.values()):.2e} (step "
          f"{max(rel, key=rel.get)})")  # fmt: skip
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert max(rel.values()) <= 1e-4  # the reshard tolerance (tests/checkpoint/test_resume.py)
