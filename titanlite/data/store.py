"""The token store: a tokenized corpus on disk as memory-mapped shards, read by every run.

A store is a directory:
- `shard-KKKKK.bin`: the tokens of documents [K*D, (K+1)*D) back to back (D = docs_per_shard),
  each one bos + tokens + eos, in the smallest unsigned dtype that holds the vocabulary;
- `shard-KKKKK.idx.npy`: int64 [docs + 1], document j of the shard = bin[o[j]:o[j+1]]. It is
  renamed into place after its .bin, so a shard whose .idx.npy exists is complete;
- `manifest.json`: format version, tokenizer identity, source name and fingerprint, dtype and
  every shard's files and counts. It is written last and the directory is renamed into place, so
  a directory with a manifest is whole.

A shard's content depends only on the corpus and D, never on how many processes wrote it, and no
file grows with the whole corpus (no 4 GB or single-file limit).
"""

import json
import os
import uuid
from functools import lru_cache
from pathlib import Path

import numpy as np

from titanlite.config import ConfigError

STORE_FORMAT_VERSION = 2  # part of the cache key and the manifest: bump when the layout changes
DOCS_PER_SHARD = 4096  # enough shards for a pool of workers on ~1 GB, few enough files at 1 TB
MANIFEST = "manifest.json"
# Memory-mapped shards kept open: a process has ~65k memory maps (vm.max_map_count), and a
# permuted epoch touches every shard; views of an evicted shard stay valid.
_MAX_OPEN_SHARDS = 1024


def token_dtype(n_words: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of a vocabulary of n_words."""
    return np.dtype(np.uint16 if n_words <= 1 << 16 else np.uint32)


def shard_files(k: int) -> tuple[str, str]:
    return f"shard-{k:05d}.bin", f"shard-{k:05d}.idx.npy"


def is_store(path: str) -> bool:
    return bool(path) and (Path(path).expanduser() / MANIFEST).is_file()


def write_shard(folder: Path, k: int, docs: list[np.ndarray], dtype: np.dtype) -> int:
    """Write shard k of `docs` (token arrays, Tokenizer.encode_array's); returns its token count."""
    return write_shard_tokens(folder, k, np.concatenate(docs), [len(d) for d in docs], dtype)


def write_shard_tokens(folder: Path, k: int, tokens: np.ndarray, lengths, dtype: np.dtype) -> int:
    """Write shard k: documents of `lengths` tokens back to back in `tokens`, under temporary
    names, then rename the tokens and last the offsets into place, so a killed writer never
    leaves a shard that looks complete. Returns the shard's token count."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    bin_name, idx_name = shard_files(k)
    tmp = temp_suffix()
    with open(folder / (bin_name + tmp), "wb") as f:
        f.write(tokens.astype(dtype, copy=False).tobytes())
    with open(folder / (idx_name + tmp), "wb") as f:  # a file object: np.save adds no suffix
        np.save(f, offsets)
    os.replace(folder / (bin_name + tmp), folder / bin_name)
    os.replace(folder / (idx_name + tmp), folder / idx_name)
    return int(offsets[-1])


def temp_suffix() -> str:
    """A name suffix of this writer's own; a build removes files left with one (`*.tmp-*`)."""
    return f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def finished_shard(folder: Path, k: int, num_docs: int, dtype: np.dtype) -> int | None:
    """The token count of shard k if it is complete and holds `num_docs` documents, else None."""
    bin_name, idx_name = shard_files(k)
    try:
        offsets = np.load(folder / idx_name, mmap_mode="r")
        size = (folder / bin_name).stat().st_size
    except (OSError, ValueError):  # absent, or cut short by a kill
        return None
    if len(offsets) != num_docs + 1 or size != int(offsets[-1]) * dtype.itemsize:
        return None
    return int(offsets[-1])


class TokenStore:
    """A store opened for reading: documents and token ranges of the whole corpus, each a view
    of one memory-mapped shard, or a copy when a range crosses shards."""

    def __init__(self, path: Path, built: bool = False):
        self.path = Path(path)
        self.built = built  # True if this call tokenized; False if it reused an existing store
        self.meta = json.loads((self.path / MANIFEST).read_text())
        if self.meta.get("version") != STORE_FORMAT_VERSION:
            raise ConfigError(
                f"{self.path} holds token store format {self.meta.get('version')}, this "
                f"titanlite reads format {STORE_FORMAT_VERSION}: prepare it again with "
                "scripts/prepare_data.py"
            )
        self.dtype = np.dtype(self.meta["dtype"])
        self.docs_per_shard = self.meta["docs_per_shard"]
        self.num_docs, self.num_tokens = self.meta["num_docs"], self.meta["num_tokens"]
        # starts[k] = global index of shard k's first token; starts[-1] = num_tokens
        self._starts = np.cumsum([0] + [s["num_tokens"] for s in self.meta["shards"]])
        self._shard = lru_cache(maxsize=_MAX_OPEN_SHARDS)(self._open_shard)

    def __getstate__(self) -> dict:
        """Pickled for data workers started by spawn: the open shards stay behind."""
        return {k: v for k, v in self.__dict__.items() if k != "_shard"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._shard = lru_cache(maxsize=_MAX_OPEN_SHARDS)(self._open_shard)

    def _open_shard(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        bin_name, idx_name = shard_files(k)
        tokens = np.memmap(self.path / bin_name, dtype=self.dtype, mode="r")
        return tokens, np.load(self.path / idx_name, mmap_mode="r")

    def document(self, i: int) -> np.ndarray:
        """Document i (bos + tokens + eos), a view."""
        tokens, offsets = self._shard(i // self.docs_per_shard)
        j = i % self.docs_per_shard
        return tokens[offsets[j] : offsets[j + 1]]

    def token_range(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of all documents back to back; a view within one shard, the
        pieces concatenated across shard boundaries."""
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        pieces = []
        while start < stop:
            tokens, _ = self._shard(k)
            end = min(stop, int(self._starts[k + 1]))
            pieces.append(tokens[start - self._starts[k] : end - self._starts[k]])
            start, k = end, k + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def open_prepared(path: str, tokenizer) -> TokenStore:
    """A store named by training.dataset_path, checked against this run's tokenizer."""
    store = TokenStore(Path(path).expanduser())
    if store.meta["tokenizer"] != tokenizer.identity:
        raise ConfigError(
            f"{path} was prepared with tokenizer {store.meta['tokenizer']!r} but this run's "
            f"tokenizer is {tokenizer.identity!r}: set model.tokenizer / model.tokenizer_path / "
            "model.vocab_limit to the prepared one, or prepare the data again with "
            "scripts/prepare_data.py and this run's model options"
        )
    return store
