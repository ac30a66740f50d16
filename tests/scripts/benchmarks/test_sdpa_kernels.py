"""scripts/benchmarks/sdpa_kernels.py without a GPU: one line, exit 0 (its checks need CUDA)."""

import subprocess
import sys

import torch
from conftest import REPO


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0():
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "benchmarks" / "sdpa_kernels.py")],
        capture_output=True, text=True, env={"CUDA_VISIBLE_DEVICES": "", "PATH": ""},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"sdpa_kernels: no CUDA GPU visible to torch {torch.__version__}: nothing to check."
    ]
