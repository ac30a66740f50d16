"""Run a command N times, optionally beside CPU hogs, and tally how it ended: for hunting rare
failures (a rank's abort at teardown) that one run in dozens meets.

    python scripts/repeat_run.py --runs 30 --hogs 2 --logs /tmp/runs -- \\
        torchrun --standalone --nproc_per_node 4 train.py --checkpoint.enable ...

Each run's exit code is counted (-6: the command itself died of SIGABRT), and its output
searched for the signs of an abort: "terminate called", a rank killed by SIGABRT (torchrun's
"Signal 6 (SIGABRT)" or "exitcode: -6"), "Fatal Python error" and a segfault. A run that exits
otherwise than --expect (0 unless told) or shows a sign keeps its output under --logs. The tally
is printed at the end, one JSON line; the exit code is 1 if any run failed or showed a sign.
"""

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

SIGNS = {
    "terminate called": re.compile(r"terminate called"),
    "SIGABRT": re.compile(r"Signal 6 \(SIGABRT\)|exitcode\s*:\s*-6\b|Aborted"),
    "SIGSEGV": re.compile(r"Signal 11 \(SIGSEGV\)|exitcode\s*:\s*-11\b|Segmentation fault"),
    "Fatal Python error": re.compile(r"Fatal Python error"),
}


def hogs(n: int) -> list[subprocess.Popen]:
    """`n` niced busy loops: the loaded CI machine, where peers reach teardown far apart."""
    loop = [sys.executable, "-c", "while 1: pass"]
    return [subprocess.Popen(["nice", "-n", "10", *loop]) for _ in range(n)]


def run_once(cmd: list[str], timeout: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        out = "".join((part or b"").decode(errors="replace") for part in (e.stdout, e.stderr))
        code = "timeout"
    return code, out, time.monotonic() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--hogs", type=int, default=0, help="busy-loop processes alongside")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--logs", type=Path, help="where a failed run's output is kept")
    p.add_argument("--label", default="", help="names the tally line")
    p.add_argument("--expect", type=int, default=0, help="the exit code of a clean run")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("no command given (put it after --)")
    codes, signs, seconds = collections.Counter(), collections.Counter(), []
    busy = hogs(args.hogs)
    try:
        for i in range(args.runs):
            code, out, s = run_once(cmd, args.timeout)
            seconds.append(s)
            seen = [name for name, sign in SIGNS.items() if sign.search(out)]
            codes[str(code)] += 1
            signs.update(seen)
            print(f"run {i + 1}/{args.runs}: exit {code} {' '.join(seen)} ({s:.1f} s)", flush=True)
            if (code != args.expect or seen) and args.logs is not None:
                args.logs.mkdir(parents=True, exist_ok=True)
                (args.logs / f"{args.label or 'run'}-{i + 1}.log").write_text(out)
    finally:
        for hog in busy:
            hog.kill()
            hog.wait()
    tally = {
        "label": args.label, "runs": args.runs, "exit_codes": dict(codes), "signs": dict(signs),
        "median_s": round(sorted(seconds)[len(seconds) // 2], 1), "hogs": args.hogs,
    }  # fmt: skip
    print(json.dumps(tally), flush=True)
    return int(bool(signs) or set(codes) != {str(args.expect)})


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
