"""prepare_data.py's memory at two corpus sizes: peak RSS of its processes (the main one, the
largest worker, and all of them together, sampled every 0.2 s from /proc), its time and tokens/s,
and the extra disk beside the store at its peak. Bounded memory shows as the same peaks at both
sizes.

    python scripts/benchmarks/bench_prepare_memory.py --mb 50,500 --workers 2

The corpus (JSON lines cut from the Python standard library, bench_data.py's) and the stores go
to a temporary folder that is removed at the end. Linux only (/proc).
"""

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.benchmarks.bench_data import write_corpus  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DOC_CHARS = 2000


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _size(f: Path) -> int:
    try:
        return f.stat().st_size
    except OSError:  # removed meanwhile
        return 0


def _dir_bytes(folder: Path, pattern: str = "*") -> int:
    return sum(_size(f) for f in folder.glob(pattern)) if folder.exists() else 0


def run(corpus: Path, out: Path, workers: int) -> dict:
    cmd = [sys.executable, str(REPO / "scripts/prepare_data.py"), "--workers", str(workers),
           "--out", str(out), "--training.dataset_path", str(corpus)]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = {"main": 0, "worker": 0, "total": 0, "pieces": 0}
    partial = out.parent / f".{out.name}.partial"
    while proc.poll() is None:
        kids = _children(proc.pid)
        main, each = _rss_kib(proc.pid), [_rss_kib(k) for k in kids]
        pieces = _dir_bytes(partial, "piece-*")
        for key, value in (("main", main), ("worker", max(each, default=0)),
                           ("total", main + sum(each)), ("pieces", pieces)):  # fmt: skip
            peak[key] = max(peak[key], value)
        time.sleep(0.2)
    seconds = time.perf_counter() - start
    stdout, stderr = proc.communicate()
    if proc.returncode:
        raise SystemExit(stderr)
    line = next(ln for ln in stdout.splitlines() if "tokens/s" in ln)
    return dict(peak, seconds=seconds, line=line.strip(), store=_dir_bytes(out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", default="50,500", help="corpus sizes in MB, comma-separated")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench_prepare_memory_"))
    try:
        for mb in (int(m) for m in args.mb.split(",")):
            corpus = folder / f"corpus-{mb}mb.jsonl"
            write_corpus(corpus, mb * 1_000_000 // DOC_CHARS, DOC_CHARS)
            r = run(corpus, folder / f"store-{mb}", args.workers)
            print(f"{corpus.stat().st_size / 1e6:.0f} MB corpus, {args.workers} workers: "
                  f"{r['seconds']:.0f} s; peak RSS main {r['main'] / 1024:.0f} MiB, largest "
                  f"worker {r['worker'] / 1024:.0f} MiB, all {r['total'] / 1024:.0f} MiB; pieces "
                  f"on disk at most {r['pieces'] / 1e6:.1f} MB (store {r['store'] / 1e6:.0f} MB)"
                  f"\n  {r['line']}", flush=True)  # fmt: skip
            shutil.rmtree(folder / f"store-{mb}")
            corpus.unlink()
    finally:
        shutil.rmtree(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
