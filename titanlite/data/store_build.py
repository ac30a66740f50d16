"""Build a token store (`titanlite.data.store`) from a text source, in this process or a pool of
worker processes, resuming after a kill.

Local files are read by the workers themselves, each its own units of the files
(`titanlite.data.store_files`). Other sources (the standard library, hub streams) are read by the
main process, which hands each shard's documents to a worker; the worker tokenizes them and
writes the shard itself. Either way shard k holds documents [k*D, (k+1)*D), so the bytes do not
depend on the number of workers.

The store is built in `.<name>.partial` next to the destination. A killed build leaves it with
its finished shards (and pieces) and `build.json` (what is being built); a rerun of the same
build keeps them and redoes the rest, a different build starts it afresh. Complete, it gets its
manifest and is renamed into place.
"""

import json
import logging
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, wait
from itertools import islice
from pathlib import Path

from titanlite.config import ConfigError
from titanlite.data.pool import encode, tokenizer_pool
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
from titanlite.data.store_files import build_from_files
from titanlite.data.units import plan_units, unit_bytes

logger = logging.getLogger(__name__)

# Called once per shard with (documents, tokens, reused): reused = kept from an earlier run.
OnShard = Callable[[int, int, bool], None]


def _tokenize_shard(folder: Path, k: int, texts: list[str], dtype) -> tuple[int, ...]:
    return k, len(texts), write_shard(folder, k, encode(texts), dtype)


def _chunks(source: TextSource, docs_per_shard: int) -> Iterator[tuple[int, list[str]]]:
    docs = source.documents()
    k = 0
    while texts := list(islice(docs, docs_per_shard)):
        yield k, texts
        k += 1


def _tokenize(tasks, tokenizer, folder: Path, dtype, workers: int) -> Iterator[tuple[int, ...]]:
    """(shard, documents, tokens) of each task once written, in completion order: in this
    process (workers = 0) or a pool with at most two shards a worker in flight, so memory stays
    bounded whatever the corpus size."""
    with tokenizer_pool(workers, tokenizer) as pool:
        pending = set()
        for k, texts in tasks:
            if len(pending) >= 2 * max(workers, 1):
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                yield from (f.result() for f in done)
            pending.add(pool.submit(_tokenize_shard, folder, k, texts, dtype))
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
    unit_size: int = 0,
) -> dict | None:
    """Tokenize `source` into a store at `out` with `workers` processes (0: this process);
    returns its manifest. Finished work of an interrupted build of the same data is kept.

    `shard` = (i, n): tokenize only this machine's share (of local files: units u with
    u % n == i; else store shards k with k % n == i) into the build directory beside `out`
    (shared by n machines) and publish nothing (returns None); a build without `shard`
    afterwards finds the shares done and publishes the store. A shard's bytes depend only on
    the corpus and k, so the store is byte-identical to one machine's. `unit_size`: bytes of
    local files a worker reads as one unit (0: `titanlite.data.units.unit_bytes`)."""
    dtype = token_dtype(tokenizer.n_words)
    header = {
        "version": STORE_FORMAT_VERSION,
        "source": source.name,
        "source_fingerprint": source.fingerprint,
        "tokenizer": tokenizer.identity,
        "dtype": dtype.name,
        "docs_per_shard": docs_per_shard,
    }
    report = on_shard or (lambda docs, tokens, reused: None)
    if (local := source.local) is not None:
        files = [f for _, fs in local.runs for f in fs]
        size = unit_size or unit_bytes(files)
        units = plan_units(local.runs, size)
        # The units too identify the build: a rerun cut otherwise starts afresh.
        marker = {**header, "unit_size": size, "units": len(units)}
        partial = _open_partial(out, marker, clean=shard is None)
        args = (tokenizer, partial, dtype, docs_per_shard, workers, report, shard, units)
        if (built := build_from_files(local, *args)) is None:
            return None
        counts, skipped = built
        skipped = skipped if local.max_bad_rows else None
    else:
        partial = _open_partial(out, header, clean=shard is None)
        counts = _build_from_documents(source, tokenizer, partial, dtype, docs_per_shard,
                                       workers, report, shard)  # fmt: skip
        if shard:
            return None
        skipped = source.skipped
    if not counts:
        raise ConfigError(f"data source {source.name!r} produced no documents")
    shards = [
        dict(zip(("tokens", "offsets"), shard_files(k)), num_docs=d, num_tokens=t)
        for k, (d, t) in sorted(counts.items())
    ]
    manifest = _manifest(header, shards)
    if skipped is not None:  # training.dataset_max_bad_rows: judged by every run
        manifest.update(skipped_rows=skipped.count, last_skipped_row=skipped.last)
    _publish(partial, out, manifest)
    return manifest


def _build_from_documents(source, tokenizer, partial, dtype, docs_per_shard, workers, report,
                          shard) -> dict[int, tuple[int, int]]:  # fmt: skip
    """The main process reads the documents and hands out a shard's at a time."""
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
    return counts
