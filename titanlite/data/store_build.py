"""Build a token store (`titanlite.data.store`) from a text source, in this process or a pool of
worker processes, resuming after a kill.

The main process reads the source and hands each shard's documents to a worker; the worker
tokenizes them (the expensive part) and writes the shard itself, so only texts cross processes
and the main process does no per-token work. Shard k always holds documents [k*D, (k+1)*D), so
the bytes do not depend on the number of workers.

The store is built in `.<name>.partial` next to the destination. A killed build leaves it with
its finished shards and `build.json` (what is being built); a rerun of the same build keeps
those shards and redoes the rest, a different build starts it afresh. Complete, it gets its
manifest and is renamed into place.
"""

import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from itertools import islice
from pathlib import Path

from titanlite.config import ConfigError
from titanlite.data.sources import TextSource
from titanlite.data.store import (
    DOCS_PER_SHARD,
    MANIFEST,
    STORE_FORMAT_VERSION,
    finished_shard,
    shard_files,
    token_dtype,
    write_shard,
)

logger = logging.getLogger(__name__)

# Called once per shard with (documents, tokens, reused): reused = kept from an earlier run.
OnShard = Callable[[int, int, bool], None]

_worker_tokenizer = None  # set in each worker process by _init_worker


def _init_worker(tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer
    # A killed main process leaves its workers blocked on the task queue: exit with it instead.
    parent = multiprocessing.parent_process()
    threading.Thread(target=_exit_with_parent, args=(parent.sentinel,), daemon=True).start()


def _exit_with_parent(sentinel) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(1)


def _worker_shard(folder: Path, k: int, texts: list[str], dtype) -> tuple[int, ...]:
    # One thread per worker (not encode_batch): the pool is the parallelism.
    docs = [_worker_tokenizer.encode_array(t, bos=True, eos=True) for t in texts]
    return k, len(texts), write_shard(folder, k, docs, dtype)


def _local_shard(tokenizer, folder: Path, k: int, texts: list[str], dtype) -> tuple[int, ...]:
    docs = tokenizer.encode_batch(texts, bos=True, eos=True)  # on this rank's thread pool
    return k, len(texts), write_shard(folder, k, docs, dtype)


def _chunks(source: TextSource, docs_per_shard: int) -> Iterator[tuple[int, list[str]]]:
    docs = source.documents()
    k = 0
    while texts := list(islice(docs, docs_per_shard)):
        yield k, texts
        k += 1


def _tokenize(tasks, tokenizer, folder: Path, dtype, workers: int) -> Iterator[tuple[int, ...]]:
    """(shard, documents, tokens) of each task once written, in completion order. workers = 0:
    in this process (encode_batch uses its threads); else a pool of spawned processes with at
    most two shards each in flight, so memory stays bounded whatever the corpus size."""
    if workers == 0:
        for k, texts in tasks:
            yield _local_shard(tokenizer, folder, k, texts, dtype)
        return
    spawn = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    with ProcessPoolExecutor(workers, spawn, _init_worker, (tokenizer,)) as pool:
        pending = set()
        for k, texts in tasks:
            if len(pending) >= 2 * workers:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                yield from (f.result() for f in done)
            pending.add(pool.submit(_worker_shard, folder, k, texts, dtype))
        for f in pending:
            yield f.result()


def _open_partial(out: Path, header: dict, clean: bool = True) -> Path:
    """The build directory: an interrupted build of the same header is kept (its finished
    shards are reused), anything else there is removed. `clean`: remove half-written files too
    (not while other machines may be writing their shares of it)."""
    partial = out.parent / f".{out.name}.partial"
    marker = partial / "build.json"
    if partial.exists():
        same = marker.is_file() and json.loads(marker.read_text()) == header
        if not same:
            logger.info("removing %s: an interrupted build of other data", partial)
            shutil.rmtree(partial)
    partial.mkdir(parents=True, exist_ok=True)
    for stale in partial.glob("*.tmp-*") if clean else ():  # a killed writer's half-written file
        stale.unlink()
    marker.write_text(json.dumps(header, indent=1))
    return partial


def _manifest(header: dict, shards: list[dict]) -> dict:
    return {
        **header,
        "num_docs": sum(s["num_docs"] for s in shards),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "shards": shards,
    }


def _publish(partial: Path, out: Path, manifest: dict) -> None:
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
    (partial / "build.json").unlink()
    try:
        partial.rename(out)  # atomic; fails if another builder published first
    except OSError:
        if not (out / MANIFEST).exists():
            raise
        shutil.rmtree(partial)


def build_store(
    source: TextSource,
    tokenizer,
    out: Path,
    workers: int = 0,
    docs_per_shard: int = DOCS_PER_SHARD,
    on_shard: OnShard | None = None,
    shard: tuple[int, int] | None = None,
) -> dict | None:
    """Tokenize `source` into a store at `out` with `workers` processes (0: this process);
    returns its manifest. Finished shards of an interrupted build of the same data are kept.

    `shard` = (i, n): tokenize only store shards k with k % n == i into the build directory
    beside `out` (shared by n machines) and publish nothing (returns None); a build without
    `shard` afterwards finds them finished and publishes the store. A shard's bytes depend only
    on the corpus and k, so the store is byte-identical to one machine's."""
    dtype = token_dtype(tokenizer.n_words)
    header = {
        "version": STORE_FORMAT_VERSION,
        "source": source.name,
        "source_fingerprint": source.fingerprint,
        "tokenizer": tokenizer.identity,
        "dtype": dtype.name,
        "docs_per_shard": docs_per_shard,
    }
    partial = _open_partial(out, header, clean=shard is None)
    report = on_shard or (lambda docs, tokens, reused: None)
    counts: dict[int, tuple[int, int]] = {}

    def todo():  # the shards not kept from an earlier run; runs in this (main) process
        for k, texts in _chunks(source, docs_per_shard):
            if shard and k % shard[1] != shard[0]:
                continue  # another machine's
            kept = finished_shard(partial, k, len(texts), dtype)
            if kept is None:
                yield k, texts
            else:
                counts[k] = (len(texts), kept)
                report(len(texts), kept, True)

    for k, docs, tokens in _tokenize(todo(), tokenizer, partial, dtype, workers):
        counts[k] = (docs, tokens)
        report(docs, tokens, False)
    if shard:
        return None
    if not counts:
        raise ConfigError(f"data source {source.name!r} produced no documents")
    shards = [
        dict(zip(("tokens", "offsets"), shard_files(k)), num_docs=d, num_tokens=t)
        for k, (d, t) in sorted(counts.items())
    ]
    manifest = _manifest(header, shards)
    if source.skipped is not None:  # training.dataset_max_bad_rows: judged by every run
        manifest.update(skipped_rows=source.skipped.count, last_skipped_row=source.skipped.last)
    _publish(partial, out, manifest)
    return manifest
