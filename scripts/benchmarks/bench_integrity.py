"""What checkpoint checksums cost: the hashes' speed, and a save and a load of one model with and
without them (one process, fp32 + AdamW, as scripts/benchmarks/bench_checkpoint.py builds it).

    python scripts/benchmarks/bench_integrity.py               # the 1B flavor (about 12 GB on disk)
    python scripts/benchmarks/bench_integrity.py --model 1B:4 --repeats 3 --folder /fast/disk/tmp

Hashes: 1 GiB of random bytes in 16 MiB chunks (as integrity.py reads files), best of 3, for
xxh3_64 (what titanlite uses), xxh64 and zlib.crc32, and crc32c / google-crc32c when installed.
Save: a synchronous `CheckpointManager.save` until published, as titanlite saves (each file
hashed as it is written, the digests gathered into the marker) and with DCP's plain writer and
no checksums, alternated `--repeats` times (median).
Load: the planning (`plan_load`, where the files are verified) plus `CheckpointManager.load`, with
checkpoint.verify_on_load on and off, alternated `--repeats` times (median). Reads come from the
page cache as far as the checkpoint fits in memory: they compare, but are not the disk's.
"""

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from dataclasses import replace
from pathlib import Path

import torch.distributed.checkpoint as dcp
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_checkpoint import _State, build, state_gib  # noqa: E402

import titanlite.checkpoint.manager as manager  # noqa: E402
from titanlite.checkpoint import CheckpointManager, plan_load  # noqa: E402
from titanlite.config import Checkpoint  # noqa: E402

CHUNK = 16 * 2**20


def _hashes() -> dict:
    """name -> (new, update(state, chunk) -> state): the streaming form of each hash."""

    def hasher(new):
        return new, lambda h, chunk: (h.update(chunk), h)[1]

    found = {
        "xxh3_64 (xxhash)": hasher(xxhash.xxh3_64),
        "xxh64 (xxhash)": hasher(xxhash.xxh64),
        "crc32 (zlib)": (lambda: 0, lambda h, chunk: zlib.crc32(chunk, h)),
    }
    try:
        import crc32c

        found["crc32c (crc32c)"] = (lambda: 0, lambda h, chunk: crc32c.crc32c(chunk, h))
    except ImportError:
        pass
    try:
        import google_crc32c

        # Its C extension takes bytes only: a 16 MiB copy per chunk, counted.
        found["crc32c (google-crc32c)"] = (
            google_crc32c.Checksum, lambda h, chunk: (h.update(bytes(chunk)), h)[1],
        )  # fmt: skip
    except ImportError:
        pass
    return found


def hash_speeds() -> dict[str, float]:
    data = memoryview(os.urandom(2**30))
    speeds = {}
    for name, (new, update) in _hashes().items():
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            h = new()
            for offset in range(0, len(data), CHUNK):
                h = update(h, data[offset : offset + CHUNK])
            best = min(best, time.perf_counter() - t0)
        speeds[name] = len(data) / best
    return speeds


def save_and_load(model, opt, sched, folder: Path, repeats: int) -> dict[str, float]:
    cfg = replace(Checkpoint(), enable=True, interval=1)
    mgr = CheckpointManager(cfg, folder, model, opt, sched, _State(), _State())
    as_titanlite = manager.checksummed_writer, manager.record
    plain = lambda tmp: dcp.FileSystemWriter(str(tmp)), lambda *args: None  # noqa: E731
    saves = {True: [], False: []}
    # One checkpoint on disk at a time (1B: 12 GB), the last one with checksums, for the loads.
    for _ in range(repeats):
        for checksums in (False, True):
            shutil.rmtree(folder / cfg.folder, ignore_errors=True)
            manager.checksummed_writer, manager.record = as_titanlite if checksums else plain
            t0 = time.perf_counter()
            mgr.save(1)
            mgr.wait()
            saves[checksums].append(time.perf_counter() - t0)
            mgr._last_saved = -1  # the same step again
    loads = {True: [], False: []}
    for _ in range(repeats):
        for verify in (True, False):
            t0 = time.perf_counter()
            mgr.load(plan_load(replace(cfg, verify_on_load=verify), folder))
            loads[verify].append(time.perf_counter() - t0)
    mgr.close()
    return {
        "save": statistics.median(saves[True]),
        "save without": statistics.median(saves[False]),
        "load verified": statistics.median(loads[True]),
        "load unverified": statistics.median(loads[False]),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="1B", help="flavor[:n_layers]")
    p.add_argument("--vocab", type=int, default=2048, help="vocabulary size")
    p.add_argument("--repeats", type=int, default=2, help="saves and loads per setting (median)")
    p.add_argument("--folder", default="", help="where to write ('' = a temporary folder)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    print("\n| hash (1 GiB, 16 MiB chunks, best of 3) | GB/s |\n|---|---:|")
    for name, speed in hash_speeds().items():
        print(f"| {name} | {speed / 1e9:.2f} |")

    model, opt, sched = build(a.model, a.vocab)
    size = state_gib(model, opt)
    with tempfile.TemporaryDirectory(dir=a.folder or None) as tmp:
        res = save_and_load(model, opt, sched, Path(tmp), a.repeats)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    save, without = res["save"], res["save without"]
    verified, unverified = res["load verified"], res["load unverified"]
    print(f"\n{a.model}: {params:.1f} M params, fp32 + AdamW {size:.2f} GiB, vocab {a.vocab}, one "
          f"process; median of {a.repeats}\n")  # fmt: skip
    print("| save with checksums, s | save without, s | with / without "
          "| load verified, s | load unverified, s | verified / unverified |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {save:.2f} | {without:.2f} | {save / without:.2f} "
          f"| {verified:.2f} | {unverified:.2f} | {verified / unverified:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
