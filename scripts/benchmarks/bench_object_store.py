"""Checkpoints in object storage: save and load GB/s through CheckpointManager beside the same
server's raw put and get of the same objects (one process).

    python scripts/benchmarks/bench_object_store.py                 # moto's S3 server, started here
    AWS_ENDPOINT_URL=http://host:9000 python scripts/benchmarks/bench_object_store.py \\
        --url s3://bucket/bench                                      # a server of your own

For each model: fp32 weights plus AdamW state (after one real step), saved `--saves` times
synchronously to `--url` (a save: DCP's writes, the checksums, the COMPLETE marker, the prune of
the previous step), then loaded back (`plan_load` with its checksum verification, then
`CheckpointManager.load`; and the load alone). The baseline is the same objects, their bytes
read once into memory, put to fresh keys with fsspec's concurrent `pipe` and got back with its
concurrent `cat`: what the client and server do with no checkpoint logic around them. Without
`--url`, moto's server runs in a process of its own on 127.0.0.1 (it holds the objects in
memory; a real store's bandwidth and latency differ: compare the ratio, not the GB/s).
"""

import argparse
import logging
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_checkpoint import _State, build, state_gib  # noqa: E402

from titanlite.checkpoint import CheckpointManager, plan_load  # noqa: E402
from titanlite.checkpoint.storage import location  # noqa: E402
from titanlite.config import Checkpoint  # noqa: E402


def start_moto() -> subprocess.Popen:
    """moto's S3 server on a free loopback port, its endpoint and dummy credentials exported."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
    )  # fmt: skip
    for _ in range(200):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return server
        time.sleep(0.05)
    raise RuntimeError("moto's server did not start")


def raw_put_get(url: str, step: str) -> tuple[float, float, int]:
    """(put, get) bytes/s of the objects of `step` copied to fresh keys, and their bytes."""
    root = location(url)
    fs = root.fs
    names = [p for p in fs.find(str(location(step).path)) if not p.endswith("/COMPLETE")]
    blobs = fs.cat(names)  # into memory first: the put below times the upload alone
    copies = {f"{root.path}/raw/{Path(n).name}": b for n, b in blobs.items()}
    nbytes = sum(len(b) for b in copies.values())
    t0 = time.perf_counter()
    fs.pipe(copies)
    put = time.perf_counter() - t0
    t0 = time.perf_counter()
    fs.cat(list(copies))
    get = time.perf_counter() - t0
    fs.rm(f"{root.path}/raw", recursive=True)
    return nbytes / put, nbytes / get, nbytes


def bench(model, opt, sched, url: str, saves: int) -> dict:
    cfg = replace(Checkpoint(), enable=True, interval=1, keep_latest_k=1, folder=url)
    mgr = CheckpointManager(cfg, "", model, opt, sched, _State(), _State())
    written = []
    for step in range(1, saves + 1):
        t0 = time.perf_counter()
        mgr.save(step)
        mgr.wait()  # written, published, the previous step pruned
        written.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    plan = plan_load(cfg, "")  # the newest step, its objects verified against their checksums
    verified = time.perf_counter() - t0
    t0 = time.perf_counter()
    mgr.load(plan)
    loaded = time.perf_counter() - t0
    mgr.close()
    return {"save": statistics.median(written), "verify": verified, "load": loaded,
            "step": str(plan.path)}  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="debugmodel,1B:1", help="flavor[:n_layers], comma-separated")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size of every model")
    p.add_argument("--saves", type=int, default=3, help="saves per model (median reported)")
    p.add_argument("--url", default="", help="s3://bucket/prefix ('' = moto's server, started)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    server = None if a.url else start_moto()
    url = a.url or "s3://bench/run"
    try:
        if server is not None:
            location(url).fs.mkdir("s3://bench")
        rows = []
        for spec in a.models.split(","):
            model, opt, sched = build(spec, a.vocab)
            res = bench(model, opt, sched, f"{url}/{spec.replace(':', '_')}", a.saves)
            put, get, nbytes = raw_put_get(url, res["step"])
            rows.append((spec, state_gib(model, opt), nbytes, res, put, get))
            location(url).fs.rm(str(location(f"{url}/{spec.replace(':', '_')}").path), True)
            del model, opt, sched
    finally:
        if server is not None:
            server.terminate()
            server.wait()
    print(f"\n{url if a.url else 'moto server (own process, 127.0.0.1)'}; one process; "
          f"save = median of {a.saves}, sync, through publish and prune")  # fmt: skip
    print(f"{'model':>12} {'state GiB':>9} {'save GB/s':>9} {'put GB/s':>8} {'load GB/s':>9} "
          f"{'+verify':>8} {'get GB/s':>8}")  # fmt: skip
    for spec, gib, nbytes, r, put, get in rows:
        gb = nbytes / 1e9
        print(f"{spec:>12} {gib:>9.2f} {gb / r['save']:>9.3f} {put / 1e9:>8.3f} "
              f"{gb / r['load']:>9.3f} {gb / (r['load'] + r['verify']):>8.3f} "
              f"{get / 1e9:>8.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
