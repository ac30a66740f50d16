"""scripts/check_torch.sh: its arguments, its venv reuse and its exit code, with a stub venv
whose python records its calls (no install, no pytest run)."""

import os
import subprocess

import pytest
from conftest import REPO

SCRIPT = REPO / "scripts" / "check_torch.sh"


def run(*args, env=None):
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60
    )


@pytest.mark.parametrize("args", [[], ["-q"], ["-m", "slow"], ["latest"]])
def test_no_or_bad_version_prints_usage_and_exits_2(args):
    res = run(*args)
    assert res.returncode == 2 and res.stderr.startswith("usage:"), res.stderr


def stub_venv(venvs, version):
    """A venv whose python logs its arguments, succeeds for pip and exits with
    $STUB_PYTEST_RC for pytest."""
    python = venvs / version / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(
        '#!/usr/bin/env bash\necho "$*" >>"$(dirname "$0")/calls"\n'
        '[ "$2" = pip ] || exit "$STUB_PYTEST_RC"\n'
    )
    python.chmod(0o755)
    return python.parent / "calls"


def test_installs_once_then_reuses_and_exits_with_pytests_code(tmp_path):
    calls = stub_venv(tmp_path, "2.11.0")
    env = {**os.environ, "TORCH_VENVS": str(tmp_path), "STUB_PYTEST_RC": "0"}
    assert run("2.11.0", env=env).returncode == 0
    assert calls.read_text().splitlines() == [
        "-m pip install -q torch==2.11.0 -e .[dev]",
        "-m pytest -q -m not slow",  # the default: the non-slow tests
    ]
    calls.unlink()
    env["STUB_PYTEST_RC"] = "5"  # pytest collected no test: a failure, not a pass
    assert run("2.11.0", "-x", "tests/test_loss.py", env=env).returncode == 5
    assert calls.read_text().splitlines() == ["-m pytest -x tests/test_loss.py"]  # no install
