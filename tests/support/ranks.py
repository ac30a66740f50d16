"""Run a worker script on N gloo ranks without starting N fresh interpreters.

A Python process that imports torch, torch.distributed and titanlite spends ~4 s of CPU before
its first line of work, more than a tiny training run, and the suite starts dozens of ranks on 2
cores. Here a forkserver imports all of it once per test process, and each rank is a fork of it:
a separate process with its own environment (torchrun's variables), gloo process group and
output, as torchrun would start, less the imports. torchrun itself (its agent, restarts, nodes)
is tested as users launch it, by run_train and tests/integration/test_launch.py.
"""

import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# What the forkserver imports once, so that every rank starts with it loaded (see that module).
PRELOAD = ["rank_preload"]


def run_ranks(script, args, nproc: int, env: dict, timeout: float, free_port):
    """`python script args` on `nproc` ranks (RANK, WORLD_SIZE, MASTER_ADDR/PORT... as torchrun
    sets them; none for one process, as plain python). When a rank fails, the others are
    stopped, as torchrun does. Returns a CompletedProcess with the ranks' outputs in rank order
    and the first non-zero exit code (0 when every rank succeeded)."""
    ctx = multiprocessing.get_context("forkserver")
    _start_forkserver(ctx)
    # Removed once read; a rank's stray child still writing there must not fail the test.
    with tempfile.TemporaryDirectory(prefix="ranks_", ignore_cleanup_errors=True) as folder:
        logs = Path(folder)
        rendezvous = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), GROUP_RANK="0",
                          WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))  # fmt: skip
        procs = []
        for rank in range(nproc):
            rank_env = dict(env)
            if nproc > 1:
                rank_env.update(rendezvous, RANK=str(rank), LOCAL_RANK=str(rank))
            target_args = (str(script), [str(a) for a in args], rank_env, str(logs / str(rank)))
            procs.append(ctx.Process(target=_rank_main, args=target_args))
            procs[-1].start()
        cmd = [str(script), *map(str, args)]
        try:
            returncode = _wait(procs, timeout, cmd)
        except subprocess.TimeoutExpired:
            raise RanksTimedOut(cmd, timeout, stderr=_tails(logs, nproc)) from None
        stdout, stderr = (_joined(logs, nproc, stream) for stream in ("out", "err"))
    return subprocess.CompletedProcess([script, *args], returncode, stdout, stderr)


def start_process(script, args, env: dict, log_prefix: str) -> multiprocessing.Process:
    """`python script args` as one process forked from the warm forkserver, started and not
    waited for (a test that kills it midway); its output goes to `log_prefix`.out / .err."""
    ctx = multiprocessing.get_context("forkserver")
    _start_forkserver(ctx)
    target_args = (str(script), [str(a) for a in args], env, log_prefix)
    proc = ctx.Process(target=_rank_main, args=target_args)
    proc.start()
    return proc


class RanksTimedOut(subprocess.TimeoutExpired):
    """A launch that ran out of time, with where each rank was: its Python stacks, dumped when
    it was stopped, and the end of its stderr (a hang otherwise leaves nothing to read)."""

    def __str__(self) -> str:
        return f"{super().__str__()}; each rank's stderr ends:\n{self.stderr}"


def _start_forkserver(ctx) -> None:
    """Start this process's forkserver with PRELOAD imported, once. It imports with the sys.path
    of a fresh interpreter in the current folder (Python 3.11 does not pass on the parent's), and
    it skips a preload that fails to import, so tests/support, tests and the repository go on its
    PYTHONPATH for its start only."""
    ctx.set_forkserver_preload(PRELOAD)
    here = Path(__file__).resolve().parent
    saved = os.environ.get("PYTHONPATH")
    paths = [str(here), str(here.parent), str(here.parents[1]), *([saved] if saved else [])]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def _joined(logs: Path, nproc: int, stream: str) -> str:
    """One stream ("out" or "err") of every rank, in rank order."""
    return "".join((logs / f"{rank}.{stream}").read_text(errors="replace") for rank in range(nproc))


def _tails(logs: Path, nproc: int, chars: int = 3000) -> str:
    """The end of each rank's stderr, in rank order."""
    parts = []
    for rank in range(nproc):
        err = logs / f"{rank}.err"
        text = err.read_text(errors="replace") if err.exists() else ""
        parts.append(f"--- rank {rank} ---\n{text[-chars:]}")
    return "".join(parts)


def _rank_main(script: str, argv: list, env: dict, log_prefix: str) -> None:
    """One rank, in its fork: the environment, output to files, the script as __main__."""
    os.environ.clear()
    os.environ.update(env)
    for fd, stream in ((1, "out"), (2, "err")):
        os.dup2(os.open(f"{log_prefix}.{stream}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    # _wait's timeout asks for stacks; SIGUSR1 and SIGTERM are train.py's (save and stop).
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    import torch

    # torchrun's OMP_NUM_THREADS=1 would only be read when the thread pool starts; the fork's
    # parent has imported torch already, so the setting is applied here.
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).parent))  # as `python script` puts it first
    runpy.run_path(script, run_name="__main__")


def _wait(procs, timeout: float, cmd: list) -> int:
    """Wait for every rank; stop the rest when one fails or the time is up."""
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs):
        if time.monotonic() > deadline:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGUSR2)
            time.sleep(2)  # the stacks reach the ranks' stderr files
            _stop(procs)
            raise subprocess.TimeoutExpired(cmd, timeout)
        if any(p.exitcode not in (None, 0) for p in procs):
            time.sleep(2)  # the peers of a failed rank may be writing their own error
            _stop(procs)
            break
        time.sleep(0.05)
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    return next((code for code in codes if code != 0), 0)


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()
