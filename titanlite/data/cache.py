"""Tokens on disk for a run: the corpus tokenized once into a token store (`titanlite.data.store`)
in the cache, reused by every run, built by one process per job.

A cache directory is keyed by (store format version, source fingerprint, tokenizer identity), so
any change to the data or the tokenizer gives a new directory instead of stale tokens.
"""

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from titanlite.data.sources import TextSource
from titanlite.data.store import MANIFEST, STORE_FORMAT_VERSION, TokenStore
from titanlite.data.store_build import build_store

logger = logging.getLogger(__name__)

_WAIT_LOG_EVERY_S = 60.0


def cache_root(data_cache_dir: str = "") -> Path:
    return Path(
        data_cache_dir or os.environ.get("TITANLITE_CACHE") or "~/.cache/titanlite"
    ).expanduser()


def cache_dir(source: TextSource, tokenizer, data_cache_dir: str = "") -> Path:
    """Where the store of `source` under `tokenizer` lives in the cache."""
    key_src = [STORE_FORMAT_VERSION, source.fingerprint, tokenizer.identity]
    key = hashlib.sha256(json.dumps(key_src).encode()).hexdigest()[:16]
    return cache_root(data_cache_dir) / f"{source.name}-{key}"


def _wait_for(final: Path, timeout_s: float) -> None:
    start = time.monotonic()
    next_log = _WAIT_LOG_EVERY_S
    while not (final / MANIFEST).exists():
        waited = time.monotonic() - start
        if waited >= timeout_s:
            raise TimeoutError(
                f"waited {waited:.0f} s (training.data_build_timeout_s) for global rank 0 to "
                f"tokenize into {final}: the cache directory (training.data_cache_dir or "
                "$TITANLITE_CACHE) must be on storage shared by all nodes, or be prepared "
                "beforehand on each node with scripts/prepare_data.py"
            )
        if waited >= next_log:
            logger.warning(
                "waited %.0f s for global rank 0 to tokenize into %s (prepare it ahead with "
                "scripts/prepare_data.py)", waited, final,
            )  # fmt: skip
            next_log += _WAIT_LOG_EVERY_S
        time.sleep(min(1.0, max(timeout_s - waited, 0.01)))


def prepare_token_cache(
    source: TextSource, tokenizer, data_cache_dir: str = "", timeout_s: float = 3600.0
) -> TokenStore:
    """Tokenize `source` into the cache unless an identical store exists. One process per job
    builds it, global rank 0 (env RANK); every other rank, on every node, waits up to timeout_s
    for the finished directory (no collectives: this runs before anything else is set up, and a
    failing rank 0 makes torchrun stop the others). So shared storage is written once."""
    final = cache_dir(source, tokenizer, data_cache_dir)
    if (final / MANIFEST).exists():
        return TokenStore(final, built=False)
    if int(os.environ.get("RANK", "0")) == 0:
        logger.info("tokenizing %s into %s", source.name, final)
        build_store(source, tokenizer, final)
        return TokenStore(final, built=True)
    _wait_for(final, timeout_s)
    return TokenStore(final, built=False)
