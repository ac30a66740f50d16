"""scripts/benchmarks/sdpa_kernels.py without a GPU: one line, exit 0 (its checks need CUDA)."""

import torch
from script_runner import run_script


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0():
    proc = run_script("benchmarks/sdpa_kernels", env={"CUDA_VISIBLE_DEVICES": "", "PATH": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"sdpa_kernels: no CUDA GPU visible to torch {torch.__version__}: nothing to check."
    ]
