"""Checkpoint I/O against the disk: save and load GB/s beside the folder's own sequential write
and read bandwidth, and how long a save blocks the training loop, sync vs async (one process).

    python scripts/benchmarks/bench_checkpoint.py                  # debugmodel and 1B with 4 layers
    python scripts/benchmarks/bench_checkpoint.py --models 1B:16 --saves 5 --folder /fast/disk/tmp

For each model: fp32 weights plus AdamW state (after one real step, so the moments exist), saved
through CheckpointManager `--saves` times per mode. An async save is followed by what a training
loop does next: the next step's forward and backward (`--step_tokens` tokens), then the wait a
trainer makes before its optimizer step (`wait_for_staging`). "blocked" is how long the caller is
held: for sync `save()`, the whole write (publishing and pruning run in a background thread); for
async `save()` plus that wait, the part of the staging copy into host memory that the forward and
backward did not hide (the copy runs in a thread beside them, the write in another). "step" is
that forward and backward's time, beside its time with no save in flight: the copy and the write
(DCP's threads plan, serialize and hash in Python) take cores, memory bandwidth and the GIL.
The first async save allocates the staging buffers, later ones copy into the same buffers, so
first and later saves are reported apart (later: median). "written" is until the checkpoint is
complete on disk, published and the older ones pruned (`wait()` returned). Async mode holds a
second copy of the state in memory for as long as the manager lives (the staging buffers).

The disk's own bandwidth is measured the same way in the same folder: a file of the state's size
written in 64 MiB blocks and fsynced (as DCP fsyncs each file), then read back. Load is a full
resume (`CheckpointManager.load`) of the last synchronous save, followed at once by one
sequential read of the files it loaded (the disk's speed drifts from minute to minute, so this is
the baseline beside it; the first read is minutes away). Reads, ours and the baseline's
alike, come from the page cache when the state fits in memory: they compare, but are not the
disk's. `--cold` empties the page cache before each read (Linux, as root), so both read the disk.
"""

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from titanlite.checkpoint import CheckpointManager, LoadPlan  # noqa: E402
from titanlite.config import Checkpoint  # noqa: E402
from titanlite.models.decoder.model import Transformer  # noqa: E402
from titanlite.models.llama.args import get_model_args  # noqa: E402


class _State:
    """Stands in for the data loader and train state: tiny dicts, as the real ones are."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, sd):
        self.step = sd["step"]


def build(spec: str, vocab: int):
    """`flavor` or `flavor:n_layers` -> model and AdamW with its state populated by one step."""
    flavor, _, layers = spec.partition(":")
    args = get_model_args(flavor, vocab_size=vocab, max_seq_len=64)
    if layers:
        args = replace(args, n_layers=int(layers))
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, vocab, (1, 16))  # [b, s]
    model(tokens, tokens).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched


def state_gib(model, opt) -> float:
    tensors = list(model.parameters()) + [
        v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
    ]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**30


def drop_page_cache() -> None:
    """Write back and forget cached file pages, so the next read comes from the disk."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def disk_bandwidth(folder: Path, nbytes: int, cold: bool) -> tuple[float, float]:
    """(write, read) bytes/s of one file of `nbytes` in 64 MiB blocks, fsynced after writing."""
    block = os.urandom(64 * 2**20)
    path = folder / "bandwidth.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for offset in range(0, nbytes, len(block)):
            f.write(block[: nbytes - offset])
        f.flush()
        os.fsync(f.fileno())
    write = nbytes / (time.perf_counter() - t0)
    read = read_rate([path], cold)
    path.unlink()
    return write, read


def read_rate(paths: list[Path], cold: bool) -> float:
    """Bytes/s of reading `paths` one after another in 64 MiB blocks, as one sequential reader."""
    if cold:
        drop_page_cache()
    buffer = bytearray(64 * 2**20)  # reused: the read's own cost, not fresh memory's
    t0 = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
    return sum(p.stat().st_size for p in paths) / (time.perf_counter() - t0)


def forward_backward(model, tokens) -> float:
    """The next training step's forward and backward (what an async save's copy overlaps);
    returns its seconds."""
    t0 = time.perf_counter()
    model(tokens, tokens).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def bench(model, opt, sched, mode: str, saves: int, folder: Path, cold: bool, tokens) -> dict:
    cfg = replace(Checkpoint(), enable=True, interval=1, keep_latest_k=1, async_mode=mode)
    mgr = CheckpointManager(cfg, folder, model, opt, sched, _State(), _State())
    blocked, written, steps = [], [], []
    for step in range(1, saves + 1):
        t0 = time.perf_counter()
        mgr.save(step)
        blocked.append(time.perf_counter() - t0)
        steps.append(0.0)  # a sync save has written everything before the step starts
        if mode == "async":
            steps[-1] = forward_backward(model, tokens)
            t1 = time.perf_counter()
            mgr.wait_for_staging()  # a trainer's wait before its optimizer step
            blocked[-1] += time.perf_counter() - t1
        mgr.wait()  # a training loop would run more steps here; waited for to time the write
        written.append(time.perf_counter() - t0)
    if cold:
        drop_page_cache()
    t0 = time.perf_counter()
    mgr.load(LoadPlan(folder / cfg.folder / f"step-{saves}", weights_only=False))
    loaded = time.perf_counter() - t0
    # The disk's speed drifts from minute to minute: read the loaded files again, right away.
    files = sorted((folder / cfg.folder / f"step-{saves}").glob("*.distcp"))
    reread = read_rate(files, cold)
    mgr.close()
    shutil.rmtree(folder / cfg.folder, ignore_errors=True)
    return {
        "first": blocked[0],
        "later": statistics.median(blocked[1:]),
        "written": statistics.median(written[1:]),
        "step": statistics.median(steps[1:]),
        "loaded": loaded,
        "reread": reread,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="debugmodel,1B:4", help="flavor[:n_layers], comma-separated")
    p.add_argument("--vocab", type=int, default=2048, help="vocabulary size of every model")
    p.add_argument("--saves", type=int, default=5, help="saves per mode (>= 2: first + later)")
    p.add_argument("--folder", default="", help="where to write ('' = a temporary folder)")
    p.add_argument("--cold", action="store_true", help="read from the disk, not the page cache")
    p.add_argument("--step_tokens", type=int, default=64, help="tokens of the step after a save")
    a = p.parse_args(argv)
    if a.saves < 2:
        p.error("--saves must be at least 2: the first save and the later ones are reported apart")
    if a.folder and not Path(a.folder).is_dir():
        p.error(f"--folder {a.folder}: no such directory (create it, or leave --folder out)")
    if a.cold and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        p.error("--cold empties the page cache through /proc/sys/vm/drop_caches: Linux, as root")
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for spec in a.models.split(","):
        model, opt, sched = build(spec, a.vocab)
        size = state_gib(model, opt)
        tokens = torch.randint(0, a.vocab, (1, a.step_tokens))
        alone = statistics.median(forward_backward(model, tokens) for _ in range(3))
        with tempfile.TemporaryDirectory(dir=a.folder or None) as tmp:
            disk = disk_bandwidth(Path(tmp), int(size * 2**30), a.cold)
            res = {
                m: bench(model, opt, sched, m, a.saves, Path(tmp), a.cold, tokens)
                for m in ("disabled", "async")
            }
        res["alone"] = alone
        params = sum(p.numel() for p in model.parameters()) / 1e6
        rows.append((spec, params, size, disk, res))
        del model, opt, sched
    print(f"\n{a.saves} saves per mode (later = median of saves 2-{a.saves}), one process, "
          f"fp32 + AdamW, vocab {a.vocab}; blocked = save() and the wait before the next "
          f"optimizer step hold the caller, s; step = the next forward and backward "
          f"({a.step_tokens} tokens), s\n")  # fmt: skip
    print("| model | params (M) | state (GiB) | sync blocked 1st / later | async blocked 1st "
          "/ later | async written (later) | async / sync blocked (later) "
          "| step alone / beside the async save |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for spec, params, size, _, res in rows:
        sync, asy = res["disabled"], res["async"]
        print(f"| {spec} | {params:.1f} | {size:.2f} | {sync['first']:.3f} / {sync['later']:.3f} "
              f"| {asy['first']:.3f} / {asy['later']:.3f} | {asy['written']:.3f} "
              f"| {asy['later'] / sync['later']:.2f} "
              f"| {res['alone']:.3f} / {asy['step']:.3f} |")  # fmt: skip
    reads = "the disk (page cache emptied first)" if a.cold else "the page cache where it fits"
    print(f"\nGB/s (1e9 bytes); disk = the folder's own fsynced write / read of the same size; "
          f"its files = one sequential read of the loaded checkpoint's files right after the "
          f"load; reads from {reads}\n")  # fmt: skip
    print("| model | disk write | sync save | save / disk | disk read | load | load / disk "
          "| its files read | load / its files | async blocked / async written |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for spec, _, size, (write, read), res in rows:
        nbytes, sync, asy = size * 2**30, res["disabled"], res["async"]
        save, load, reread = nbytes / sync["written"], nbytes / sync["loaded"], sync["reread"]
        print(f"| {spec} | {write / 1e9:.2f} | {save / 1e9:.2f} | {save / write:.0%} "
              f"| {read / 1e9:.2f} | {load / 1e9:.2f} | {load / read:.0%} "
              f"| {reread / 1e9:.2f} | {load / reread:.0%} "
              f"| {asy['later'] / asy['written']:.0%} |")  # fmt: skip


if __name__ == "__main__":
    main()
