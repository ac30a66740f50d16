"""torchrun agents launched as users launch them, for the tests that kill, restart and resize
them (tests/integration/test_launch.py, test_elastic.py): their command, their workers, their
end."""

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TRAIN, read_jsonl


def agent_env(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def torchrun(launch: list[str], args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launch, str(TRAIN), *args]


def last_losses(folder: Path) -> dict[int, float]:
    """step -> loss of its last occurrence: steps re-done after a restart are logged twice."""
    return {r["step"]: r["loss"] for r in read_jsonl(folder / "metrics.jsonl")}


def workers(agent_pid: int) -> list[int]:
    """The train.py processes torchrun started (its children)."""
    out = subprocess.run(["pgrep", "-P", str(agent_pid)], capture_output=True, text=True)
    pids = [int(p) for p in out.stdout.split()]
    return [p for p in pids if "train.py" in Path(f"/proc/{p}/cmdline").read_text(errors="ignore")]


def kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and its workers, as a node dies: the workers outlive a killed agent."""
    pids = workers(agent.pid)
    agent.kill()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile
            os.kill(pid, signal.SIGKILL)
    agent.wait()


def finish(proc: subprocess.Popen, timeout: int = 300, log: Path | None = None) -> str:
    """The agent's output (piped, or written to `log`) once it exits 0; a failed test otherwise
    (killing it if it hangs)."""
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        kill_node(proc)
        out = proc.communicate()[0] if log is None else log.read_text()
        pytest.fail(f"still running after {timeout} s:\n{out[-6000:]}")
    # A piped agent may have printed nothing (an empty string is its whole output).
    out = out if log is None else log.read_text()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-6000:]}"
    return out
