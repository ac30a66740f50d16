"""A save killed while writing to object storage, end to end: train.py (the debug model, one
process, checkpoints every 2 steps to moto's S3 server on 127.0.0.1) is SIGKILLed once the
objects of a step are stored but its COMPLETE marker is not; the same command is run again.

    python scripts/benchmarks/drill_object_store_kill.py

Reports the killed step, how long after the rerun's launch it was reported as partial, the step
the rerun resumed from and when it trained again: the row of docs/faults.md.
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_object_store import start_moto  # noqa: E402

from titanlite.checkpoint.storage import location  # noqa: E402

URL = "s3://drill/run/checkpoint"
ARGS = [
    "--job.config_file", "debug_model.toml", "--model.flavor", "debugmodel_4L",
    "--model.vocab_limit", "512", "--training.seq_len", "32", "--training.local_batch_size", "2",
    "--training.global_batch_size", "8", "--training.steps", "40", "--metrics.log_freq", "1",
    "--no-metrics.enable_tensorboard", "--metrics.peak_tflops", "1", "--checkpoint.enable",
    "--checkpoint.interval", "2", "--checkpoint.folder", URL,
]  # fmt: skip


def midway(folder) -> int | None:
    """A step with stored objects and no marker yet (a save in flight), if any."""
    steps = {}
    for name in folder.fs.find(str(folder.path)):
        m = re.search(r"/step-(\d+)/(.+)$", name)
        if m:
            steps.setdefault(int(m.group(1)), set()).add(m.group(2))
    partial = [s for s, names in steps.items() if "COMPLETE" not in names and len(names) > 1]
    return max(partial) if partial and max(steps) >= 4 else None


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    server = start_moto()
    folder = location(URL)
    folder.fs.mkdir("s3://drill")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        with tempfile.TemporaryDirectory() as dump:
            cmd = [sys.executable, str(ROOT / "train.py"), *ARGS, "--job.dump_folder", dump]
            run = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)  # fmt: skip
            while (killed := midway(folder)) is None:
                if run.poll() is not None:
                    raise RuntimeError(f"train.py exited {run.returncode} before a save midway")
                time.sleep(0.01)
            run.send_signal(signal.SIGKILL)
            run.wait()
            stored = sorted(
                n.rsplit("/", 1)[1] for n in folder.fs.find(f"{folder.path}/step-{killed}")
            )
            print(f"killed in the save of step {killed}: stored {stored}, no COMPLETE")
            t0 = time.perf_counter()
            rerun = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)  # fmt: skip
            for line in rerun.stdout:
                if "Ignoring partial checkpoint" in line or "Loaded model" in line:
                    print(f"{time.perf_counter() - t0:6.1f} s  {line.strip()}")
                if re.search(r" INFO step +\d+ ", line):
                    print(f"{time.perf_counter() - t0:6.1f} s  first step: {line.strip()}")
                    break
            rerun.kill()
            rerun.wait()
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
