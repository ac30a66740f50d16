"""scripts/benchmarks/bench_overhead.py: it runs both steps on the thread count it is given."""

import os
import re
import subprocess
import sys

from conftest import REPO

from titanlite.host import cpus_per_local_rank


def test_threads_is_the_count_the_steps_run_on(tmp_path):
    # Not the count train.py's start would pick by itself (cores // local processes).
    threads = 1 if cpus_per_local_rank() > 1 else 2
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cmd = [
        sys.executable, str(REPO / "scripts" / "benchmarks" / "bench_overhead.py"),
        "--custom_model", "64,1,4", "--batch", "1", "--seq_len", "32", "--threads", str(threads),
        "--warmup", "0", "--steps", "1", "--rounds", "3", "--dump_folder", str(tmp_path),
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"float32, threads {threads}\n" in out.stdout
    assert re.search(r"^step/floor \d+\.\d\d$", out.stdout, re.MULTILINE)
