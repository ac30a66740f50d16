"""Tokens on disk: a corpus tokenized once into a memory-mapped cache, reused by every run.

A cache directory is keyed by (format version, source fingerprint, tokenizer identity), so any
change to the data or the tokenizer gives a new directory instead of stale tokens. It is built
in a temporary directory and renamed into place, so a cache directory exists only when complete.
"""

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from array import array
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import numpy as np

from titanlite.data.sources import TextSource

logger = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1  # part of the cache key: bump it when the on-disk layout changes
_DOCS_PER_CHUNK = 256  # documents per encode_batch call: enough to keep all cores busy


def cache_root(data_cache_dir: str = "") -> Path:
    return Path(
        data_cache_dir or os.environ.get("TITANLITE_CACHE") or "~/.cache/titanlite"
    ).expanduser()


def encode_documents(
    source: TextSource, tokenizer, docs_per_call: int = _DOCS_PER_CHUNK
) -> Iterator[list[int]]:
    """Each document of `source` as bos + tokens + eos, in source order: the one layout the cache
    stores and the streamed path produces, so both give the same samples."""
    docs = source.documents()
    while chunk := list(islice(docs, docs_per_call)):
        yield from tokenizer.encode_batch(chunk, bos=True, eos=True)


class TokenCache:
    """A tokenized corpus on disk: tokens.bin (uint32, all documents back to back, each one
    bos + tokens + eos), offsets.npy (int64 [num_docs + 1], document i = tokens[o[i]:o[i+1]]) and
    meta.json. The directory is renamed into place when complete, so it exists only if whole."""

    def __init__(self, path: Path, built: bool):
        self.path = path
        self.built = built  # True if this call tokenized; False if it reused an existing cache
        self.meta = json.loads((path / "meta.json").read_text())
        self.tokens = np.memmap(path / "tokens.bin", dtype=np.uint32, mode="r")
        self.offsets = np.load(path / "offsets.npy")
        self.num_docs = len(self.offsets) - 1


def _build_cache(source: TextSource, tokenizer, final: Path) -> None:
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        start, offsets = time.perf_counter(), array("q", [0])  # 8 bytes/doc, not a PyObject
        with open(tmp / "tokens.bin", "wb") as f:
            for ids in encode_documents(source, tokenizer):
                f.write(np.asarray(ids, dtype=np.uint32).tobytes())
                offsets.append(offsets[-1] + len(ids))
        if len(offsets) == 1:
            raise ValueError(f"data source {source.name!r} produced no documents")
        np.save(tmp / "offsets.npy", np.frombuffer(offsets, dtype=np.int64))
        meta = {
            "version": CACHE_FORMAT_VERSION,
            "source": source.name,
            "source_fingerprint": source.fingerprint,
            "tokenizer": tokenizer.identity,
            "num_tokens": offsets[-1],
            "num_docs": len(offsets) - 1,
            "seconds": round(time.perf_counter() - start, 3),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, final)  # atomic; fails if another node's rank 0 won the race
        except OSError:
            if not (final / "meta.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prepare_token_cache(source: TextSource, tokenizer, data_cache_dir: str = "") -> TokenCache:
    """Tokenize `source` into the cache unless an identical cache exists. Under torchrun only
    LOCAL_RANK 0 tokenizes; the others wait for the finished directory (no collectives: this runs
    before anything else is set up, and a failing rank 0 makes torchrun stop the others)."""
    key_src = [CACHE_FORMAT_VERSION, source.fingerprint, tokenizer.identity]
    key = hashlib.sha256(json.dumps(key_src).encode()).hexdigest()[:16]
    final = cache_root(data_cache_dir) / f"{source.name}-{key}"
    if (final / "meta.json").exists():
        return TokenCache(final, built=False)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        logger.info("tokenizing %s into %s", source.name, final)
        _build_cache(source, tokenizer, final)
        return TokenCache(final, built=True)
    waited = 0
    while not (final / "meta.json").exists():
        time.sleep(1.0)
        waited += 1
        if waited % 60 == 0:
            logger.info("waiting %d s for local rank 0 to tokenize into %s", waited, final)
    return TokenCache(final, built=False)
