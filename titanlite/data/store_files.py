"""A token store built from local files read in parallel from the start: each worker reads its
own units of the files (`titanlite.data.units`: byte ranges, row groups, whole small files),
tokenizes them and writes a piece (its tokens and document offsets); the main process copies the
pieces, in unit order, into the store's shards of D documents and deletes each piece once all
its documents are in written shards. Only tokens cross processes, through the disk; nothing
makes a copy of the text first, and the pieces on disk at any time are those of the shard being
filled and of the units in flight (a window of a few per worker), so disk and memory stay
bounded at any corpus size.

Shard k holds documents [k*D, (k+1)*D) of the files read in order, as a build from the whole
files does, so the store's bytes do not depend on the units, the workers or the machines.

Resuming: written shards are a prefix (the main process writes them in order); `units.jsonl`
lists the units whose documents all lie in written shards (their pieces deleted), so a rerun
knows where the first unwritten shard starts and reuses the pieces still there. With a share
of several machines (`shard` = (i, n)), machine i only tokenizes units u with u % n == i into
pieces beside the store; the build without a share then finds them and copies them into shards.
"""

import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, wait
from functools import partial
from pathlib import Path

import numpy as np

from titanlite.data.diagnose import SkippedRows, bad_row_error
from titanlite.data.pool import encode, tokenizer_pool
from titanlite.data.sources import LocalFiles
from titanlite.data.store import finished_shard, temp_suffix, write_shard_tokens
from titanlite.data.units import Unit, unit_rows

LEDGER = "units.jsonl"
_BATCH_DOCS, _BATCH_CHARS = 256, 1 << 20  # texts tokenized and written at a time by a worker

OnShard = Callable[[int, int, bool], None]


def _piece_files(u: int) -> tuple[str, str, str]:
    return f"piece-{u:06d}.bin", f"piece-{u:06d}.idx.npy", f"piece-{u:06d}.json"


def _read_piece(folder: Path, u: int) -> dict | None:
    """A finished piece's counts (its .json is renamed into place last), or None."""
    try:
        return json.loads((folder / _piece_files(u)[2]).read_text())
    except (OSError, ValueError):
        return None


def tokenize_unit(folder: Path, u: int, unit: Unit, text_column: str, max_bad_rows: int, dtype):
    """Read, tokenize and write unit u as a piece, texts a batch at a time (memory: one batch);
    returns its counts. A bad row stops the build, unless bad rows may be skipped: then the
    first max_bad_rows + 1 are kept for the main process, which counts them in unit order.
    (The source's file list is not an argument: it is pickled for every task.)"""
    names = [folder / n for n in _piece_files(u)]
    tmp = temp_suffix()
    lengths, texts, chars = [], [], 0
    meta = {"docs": 0, "tokens": 0, "skipped": 0, "problems": [], "last": ""}

    def flush(f) -> None:
        docs = encode(texts)
        f.write(np.concatenate(docs).astype(dtype, copy=False).tobytes())
        lengths.extend(len(d) for d in docs)
        texts.clear()

    with open(str(names[0]) + tmp, "wb") as f:
        for text, problem in unit_rows(unit, text_column):
            if problem:
                if not max_bad_rows:
                    raise bad_row_error(problem, unit[0].builder)
                meta["skipped"], meta["last"] = meta["skipped"] + 1, problem
                if len(meta["problems"]) <= max_bad_rows:
                    meta["problems"].append(problem)
            elif text:
                texts.append(text)
                chars += len(text)
                if len(texts) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
                    flush(f)
                    chars = 0
        if texts:
            flush(f)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    with open(str(names[1]) + tmp, "wb") as f:
        np.save(f, offsets)
    meta.update(docs=len(lengths), tokens=int(offsets[-1]))
    (Path(str(names[2]) + tmp)).write_text(json.dumps(meta))
    for name in names:  # the counts last: a piece with its .json is whole
        os.replace(str(name) + tmp, name)
    return meta


class _Ledger:
    """units.jsonl: the counts of the units already copied into shards, in unit order."""

    def __init__(self, folder: Path):
        self.path = folder / LEDGER
        self.entries = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    self.entries.append(json.loads(line))
                except ValueError:  # the line a kill cut short, always the last
                    break
            self.path.write_text("".join(json.dumps(e) + "\n" for e in self.entries))

    def reset(self) -> None:
        self.entries = []
        self.path.unlink(missing_ok=True)

    def add(self, meta: dict) -> None:
        entry = {k: meta[k] for k in ("docs", "tokens", "skipped", "last")}
        with open(self.path, "a") as f:  # written before the piece is deleted
            f.write(json.dumps(entry) + "\n")
        self.entries.append(entry)


class _Shards:
    """Pieces in unit order -> shards of `docs_per_shard` documents, written as they fill.
    Documents are numbered across the corpus: the next one added is `self.doc`, and the written
    shards (kept ones included) hold those below `self.written`."""

    def __init__(self, folder, docs_per_shard, dtype, first_shard, doc, written, ledger, report):
        self.folder, self.per_shard, self.dtype = folder, docs_per_shard, dtype
        self.k, self.doc, self.written = first_shard, doc, written
        self.ledger, self.report = ledger, report
        self.chunks, self.lengths, self.filled, self.reused = [], [], 0, True
        self.open_units = []  # (u, meta, end) whose documents below `end` are not all written
        self.counts: dict[int, tuple[int, int]] = {}  # shard -> (documents, tokens)

    def add(self, u: int, meta: dict, reused: bool) -> None:
        n, first = meta["docs"], self.doc
        self.open_units.append((u, meta, first + n))
        self.doc += n
        j = min(max(self.written - first, 0), n)  # documents in shards kept from an earlier run
        if j < n:
            names = [self.folder / name for name in _piece_files(u)[:2]]
            tokens = np.memmap(names[0], dtype=self.dtype, mode="r")
            offsets = np.load(names[1], mmap_mode="r")
        while j < n:
            take = min(self.per_shard - self.filled, n - j)
            self.chunks.append(tokens[offsets[j] : offsets[j + take]])
            self.lengths.append(np.diff(offsets[j : j + take + 1]))
            self.filled, self.reused, j = self.filled + take, self.reused and reused, j + take
            if self.filled == self.per_shard:
                self.write()
        self._release()

    def write(self) -> None:
        """Write the shard being filled (the last one may hold fewer documents)."""
        if self.lengths:
            lengths = np.concatenate(self.lengths)
            tokens = np.concatenate(self.chunks)
            write_shard_tokens(self.folder, self.k, tokens, lengths, self.dtype)
            self.counts[self.k] = (len(lengths), len(tokens))
            self.report(len(lengths), len(tokens), self.reused)
            self.k, self.written = self.k + 1, self.written + len(lengths)
            self.chunks, self.lengths, self.filled, self.reused = [], [], 0, True
        self._release()

    def _release(self) -> None:
        """Units whose documents are all in written shards: into the ledger, pieces deleted."""
        while self.open_units and self.open_units[0][2] <= self.written:
            u, meta, _ = self.open_units.pop(0)
            self.ledger.add(meta)
            for name in _piece_files(u):
                (self.folder / name).unlink(missing_ok=True)


def build_from_files(
    local: LocalFiles, tokenizer, folder: Path, dtype, docs_per_shard: int, workers: int,
    report: OnShard, shard: tuple[int, int] | None, units: list[Unit],
) -> tuple[dict[int, tuple[int, int]], SkippedRows] | None:  # fmt: skip
    """Tokenize `units` into shards in `folder`: {shard: (documents, tokens)} and the bad rows
    left out; with `shard` only this machine's pieces (None)."""
    job = partial(tokenize_unit, folder, text_column=local.text_column,
                  max_bad_rows=local.max_bad_rows, dtype=dtype)  # fmt: skip
    depth = 2 * max(workers, 1)  # units in flight: every worker busy, one more queued each
    with tokenizer_pool(workers, tokenizer) as pool:
        if shard:
            mine = [u for u in range(len(units)) if u % shard[1] == shard[0]]
            for meta, reused in _tokenize_share(pool, job, folder, units, mine, depth):
                report(meta["docs"], meta["tokens"], reused)
            return None
        return _assemble(pool, job, folder, units, dtype, docs_per_shard, report, depth, local)


def _tokenize_share(pool, job, folder, units, mine, depth) -> Iterator[tuple[dict, bool]]:
    pending = set()
    for u in mine:
        if (meta := _read_piece(folder, u)) is not None:
            yield meta, True
            continue
        if len(pending) >= depth:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            yield from ((f.result(), False) for f in done)
        pending.add(pool.submit(job, u, units[u]))
    yield from ((f.result(), False) for f in pending)


def _assemble(pool, job, folder, units, dtype, per_shard, report, depth, local):
    ledger = _Ledger(folder)
    start = sum(e["docs"] for e in ledger.entries)  # the first document of unit len(ledger)
    kept = _kept_shards(folder, per_shard, dtype, start)
    kept_docs = sum(d for d, _ in kept.values())
    if start > kept_docs:  # shards of the ledger's units are gone: read those units again
        ledger.reset()
        start = 0
    skipped = SkippedRows(local.max_bad_rows)
    for e in ledger.entries:
        skipped.count, skipped.last = skipped.count + e["skipped"], e["last"] or skipped.last
    for d, t in kept.values():
        report(d, t, True)
    shards = _Shards(folder, per_shard, dtype, len(kept), start, kept_docs, ledger, report)
    shards.counts.update(kept)
    ready = {u for u in range(len(ledger.entries), len(units)) if _read_piece(folder, u)}
    found, pending, nxt = set(ready), {}, len(ledger.entries)
    u = nxt
    while u < len(units):
        while nxt < len(units) and len(pending) < depth and nxt - u < 2 * depth:
            if nxt not in ready:
                pending[pool.submit(job, nxt, units[nxt])] = nxt
            nxt += 1
        if u in ready:
            meta = _read_piece(folder, u)
            for problem in meta["problems"]:  # in unit order: the count the limit judges
                skipped.add(problem)
            skipped.last = meta["last"] or skipped.last
            shards.add(u, meta, reused=u in found)
            u += 1
            continue
        done, _ = wait(pending, return_when=FIRST_COMPLETED)
        for f in done:
            f.result()  # a worker's error stops the build here
            ready.add(pending.pop(f))
    shards.write()
    (folder / LEDGER).unlink(missing_ok=True)
    return shards.counts, skipped


def _kept_shards(folder: Path, per_shard: int, dtype, start: int) -> dict[int, tuple[int, int]]:
    """The shards written before an interruption: a prefix, as they are written in order, of
    full shards, and the last one if every unit was copied (`start` documents in all)."""
    kept, k = {}, 0
    while (tokens := finished_shard(folder, k, per_shard, dtype)) is not None:
        kept[k], k = (per_shard, tokens), k + 1
    rest = start - k * per_shard
    if 0 < rest < per_shard and (tokens := finished_shard(folder, k, rest, dtype)) is not None:
        kept[k] = (rest, tokens)
    return kept
