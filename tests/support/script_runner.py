"""The user scripts of scripts/ as the tests use them: imported as modules, or run as a user runs
them (`python scripts/X.py args`) in a warm fork."""

import importlib.util
import os
from pathlib import Path

from ranks import run_ranks

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str):
    """scripts/<name>.py (name may hold a folder: "benchmarks/benchmark") imported as a module
    named after its file."""
    path = SCRIPTS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(script, *args, timeout: float = 300, env: dict | None = None):
    """`python script args` (a path, or a name as load_script takes) with its exit status and
    outputs, in a fork of a process that has imported torch and titanlite already
    (tests/support/ranks.py): a fresh interpreter spends ~4 s of CPU on the imports alone.
    `env`: the whole environment, as subprocess takes it (default: this one's)."""
    from conftest import free_port

    path = Path(script) if Path(script).is_absolute() else SCRIPTS / f"{script}.py"
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1")
    return run_ranks(path, args, 1, env, timeout, free_port)


def measured_estimate(config_file: str) -> str:
    """estimate_memory.py's output for 2 measured eager fp32 steps of a config on this CPU."""
    proc = run_script("estimate_memory", "--job.config_file", config_file, "--device", "cpu",
                      "--measure", "2", "--training.mixed_precision_param", "float32")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
