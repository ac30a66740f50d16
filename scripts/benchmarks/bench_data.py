"""Data preparation against the tokenizer's own speed: `prepare_data.py`'s build (read the
source, tokenize, write the shards) in tokens/s per worker beside tiktoken's own batch encoding
of the same documents in one process and one thread, and 2 workers beside 1.

    python scripts/benchmarks/bench_data.py                   # 80,000 documents cut from the stdlib
    python scripts/benchmarks/bench_data.py --docs 200000 --repeats 3 --workers 1,2,4

The corpus is a JSONL file of `--docs` documents of about `--doc_chars` characters each, cut from
the Python standard library's sources (what the default dataset trains on), so a build has many
shards to hand out. Each repeat times, in turn: tiktoken's `encode_ordinary_batch(texts,
num_threads=1)` of the corpus' texts (in memory: the bar a build is held to), then per worker
count W: tiktoken alone in W processes at once, each encoding a share to arrays (the machine's
limit for W workers: its cores, caches and memory shared as the workers share them), and
`build_store` (what prepare_data.py runs) with W workers into a fresh folder, the pool's start
included. Reported: medians over the repeats. The worker processes read the JSONL themselves
(`titanlite.data.units`) and share the machine with the main process, which copies their tokens
into the shards: on a machine with W cores, W workers compete with it.
"""

import argparse
import functools
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from titanlite.config import ConfigError  # noqa: E402
from titanlite.data.sources import local_source, stdlib_files  # noqa: E402
from titanlite.data.store_build import build_store  # noqa: E402
from titanlite.data.tokenizer import build_tokenizer  # noqa: E402


def write_corpus(path: Path, docs: int, doc_chars: int, c4_fields: bool = False) -> None:
    """`docs` JSONL rows of ~doc_chars characters, cut at line ends from the stdlib's sources
    (cycled when the corpus asks for more text than the stdlib holds). `c4_fields`: each row
    also carries C4's "timestamp" and "url" (the file and offset it was cut from), the schema
    torchtitan's c4 loaders read (scripts/benchmarks/bench_torchtitan.py)."""
    root, files = stdlib_files()
    written = 0
    with open(path, "w") as out:
        while written < docs:
            for f in files:
                text, start = f.read_text(encoding="utf-8", errors="replace"), 0
                while start < len(text) and written < docs:
                    end = text.find("\n", start + doc_chars)
                    end = len(text) if end < 0 else end + 1
                    row = {"text": text[start:end]}
                    if c4_fields:
                        url = f"stdlib://{f.relative_to(root).as_posix()}#{start}"
                        row |= {"timestamp": "2019-04-25T12:00:00Z", "url": url}
                    out.write(json.dumps(row) + "\n")
                    start, written = end, written + 1
                if written >= docs:
                    return


def batch_rate(tokenizer, texts: list[str]) -> float:
    """tokens/s of tiktoken's own batch encoding in this process, one thread."""
    start = time.perf_counter()
    ids = tokenizer.encoding.encode_ordinary_batch(texts, num_threads=1)
    seconds = time.perf_counter() - start
    return (sum(map(len, ids)) + 2 * len(texts)) / seconds  # + the bos and eos the store adds


_barrier = None  # in each process_rate process: all start encoding together


def _set_barrier(barrier) -> None:
    global _barrier
    _barrier = barrier


def _timed_encode(tokenizer, texts: list[str]) -> tuple[int, float]:
    # Tokenizer.encode_array's tiktoken call, spelled out so that the bench also runs on a tree
    # from before encode_array (for before/after figures).
    encode = functools.partial(
        tokenizer.encoding.encode_to_numpy, allowed_special=set(), disallowed_special=()
    )
    encode("")  # the encoding loads before the clock starts
    _barrier.wait()
    start = time.perf_counter()
    tokens = sum(len(encode(t)) + 2 for t in texts)  # + the bos and eos the store adds
    return tokens, time.perf_counter() - start


def process_rate(tokenizer, texts: list[str], workers: int) -> float:
    """tokens/s of tiktoken alone in `workers` processes at once, each encoding its share of
    the texts to arrays as a worker does (started, then released together): what the machine
    gives that many tokenizing processes, the limit for as many workers."""
    spawn = multiprocessing.get_context("spawn")
    barrier = spawn.Barrier(workers)
    with ProcessPoolExecutor(workers, spawn, _set_barrier, (barrier,)) as pool:
        shares = [pool.submit(_timed_encode, tokenizer, texts[i::workers]) for i in range(workers)]
        done = [f.result() for f in shares]
    return sum(n for n, _ in done) / max(s for _, s in done)


def build_rate(source, tokenizer, folder: Path, workers: int) -> float:
    """tokens/s of a whole build_store (prepare_data.py's work) into a fresh folder."""
    out = folder / f"store-{workers}"
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    meta = build_store(source, tokenizer, out, workers)
    seconds = time.perf_counter() - start
    shutil.rmtree(out)
    return meta["num_tokens"] / seconds


def main(argv: list[str] | None = None) -> int:
    # Imported here, not above: each spawned worker re-imports this script, and the option
    # checks import torch (~2.5 s of CPU and ~250 MB per worker) that tokenizing never uses.
    from titanlite.config_parse import parse_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=80_000, help="documents in the corpus")
    ap.add_argument("--doc_chars", type=int, default=2000, help="about this many characters each")
    ap.add_argument("--workers", default="1,2", help="worker counts to time, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--folder", default="", help="where the corpus and stores go (default: tmp)")
    args, rest = ap.parse_known_args(argv)
    try:
        workers = [int(w) for w in args.workers.split(",")]
    except ValueError:
        ap.error(f"--workers takes comma-separated counts such as 1,2; got {args.workers!r}")
    if min(workers) < 1 or args.docs < 1 or args.repeats < 1:
        ap.error("--workers counts, --docs and --repeats must be at least 1")
    try:  # the rest are train.py's options: the tokenizer's
        tokenizer = build_tokenizer(parse_args(rest).model)
    except ConfigError as e:
        ap.error(str(e))
    folder = Path(args.folder or tempfile.mkdtemp(prefix="bench_data_"))
    folder.mkdir(parents=True, exist_ok=True)
    # datasets' Arrow copy of the corpus goes with it, not into the user's cache (read at the
    # first datasets import, which comes later).
    os.environ.setdefault("HF_DATASETS_CACHE", str(folder / "hf_datasets"))
    corpus = folder / "corpus.jsonl"
    write_corpus(corpus, args.docs, args.doc_chars)
    source = local_source(str(corpus))
    texts = list(source.documents())
    chars = sum(map(len, texts))
    print(f"corpus: {len(texts):,} documents, {chars / 1e6:.1f} M characters, "
          f"tokenizer {tokenizer.identity}, {os.cpu_count()} CPUs", flush=True)  # fmt: skip
    rates: dict[str, list[float]] = {"batch": []}
    for w in workers:
        rates |= {f"tiktoken {w}": [], f"build {w}": []}
    for r in range(args.repeats):
        rates["batch"].append(batch_rate(tokenizer, texts))
        for w in workers:
            rates[f"tiktoken {w}"].append(process_rate(tokenizer, texts, w))
            rates[f"build {w}"].append(build_rate(source, tokenizer, folder, w))
        print(f"repeat {r + 1}: " + ", ".join(f"{k} {v[-1] / 1e6:.3f}" for k, v in rates.items())
              + " M tokens/s", flush=True)  # fmt: skip
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"tiktoken's encode_ordinary_batch, 1 thread: {med['batch'] / 1e6:.3f} M tokens/s")
    for w in workers:
        rate, limit = med[f"build {w}"], med[f"tiktoken {w}"]
        first, first_limit = med[f"build {workers[0]}"], med[f"tiktoken {workers[0]}"]
        print(f"prepare_data, {w} workers: {rate / 1e6:.3f} M tokens/s; per worker "
              f"{rate / w / med['batch']:.2f} x tiktoken's batch; {rate / limit:.2f} x tiktoken "
              f"alone in {w} processes ({limit / 1e6:.3f}); {rate / first:.2f} x {workers[0]} "
              f"worker(s), where tiktoken alone scales {limit / first_limit:.2f} x")  # fmt: skip
    if not args.folder:
        shutil.rmtree(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
