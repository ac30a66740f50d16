"""Tokens prepared before the run, read in place: titanlite token stores (scripts/prepare_data.py),
Megatron-LM indexed datasets (`name.bin` + `name.idx`, memory-mapped, no copy), and several of
either back to back in one source (`dataset_path = "a_store,b_store,/data/web_text_document"`).

Each opened part has the reading interface of `TokenStore`: `num_docs`, `num_tokens`,
`document(i)`, `token_range(start, stop)`, `meta` (bad rows left out) and `path`.

Megatron's index (its `MMIDIDX` format, version 1): a header, the token dtype's code, the sequence
and document counts, then int32 sequence lengths, int64 sequence byte offsets into the .bin and
int64 document boundaries (in sequences). A document is its sequences back to back. Megatron
records no tokenizer and adds BOS/EOS only as its preprocessing was told (`--append-eod`):
titanlite reads the tokens as they are, and collate checks every id against the model's
vocabulary.
"""

import bisect
import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

from titanlite.config import ConfigError
from titanlite.data.store import MANIFEST, is_store, open_prepared

MEGATRON_HEADER = b"MMIDIDX\x00\x00"
# Megatron's DType codes (megatron/core/datasets/indexed_dataset.py).
MEGATRON_DTYPES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
    7: np.float32, 8: np.uint16,
}  # fmt: skip


def parts(dataset_path: str) -> list[str]:
    return [os.path.expanduser(p.strip()) for p in dataset_path.split(",") if p.strip()]


def megatron_prefix(path: str) -> str | None:
    """`path` without .bin/.idx if it names a Megatron pair whose both files exist."""
    prefix = path.removesuffix(".bin").removesuffix(".idx")
    return prefix if Path(prefix + ".bin").is_file() and Path(prefix + ".idx").is_file() else None


def is_prepared(dataset_path: str) -> bool:
    """Every part of `dataset_path` is a token store or a Megatron pair."""
    names = parts(dataset_path) if dataset_path else []
    return bool(names) and all(is_store(p) or megatron_prefix(p) for p in names)


def describe(dataset_path: str) -> tuple[str, str]:
    """(fingerprint, what the run reads): a store's is the text it was prepared from, so that a
    checkpoint of a run on the text resumes on the store; a Megatron pair's its files' stats."""
    prints, lines = [], []
    for p in parts(dataset_path):
        if is_store(p):
            meta = json.loads((Path(p) / MANIFEST).read_text())
            prints.append(meta["source_fingerprint"])
            lines.append(f"token store {p} ({meta['num_docs']} documents)")
        else:
            files = [Path(megatron_prefix(p) + ext) for ext in (".bin", ".idx")]
            prints.append([[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files])
            lines.append(f"Megatron tokens {files[0]} (tokenizer not recorded)")
    fingerprint = prints[0] if len(prints) == 1 else _hash(prints)
    return fingerprint, ", ".join(lines)


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


class MegatronTokens:
    """A Megatron-LM .bin/.idx pair, memory-mapped: documents and token ranges are views."""

    def __init__(self, prefix: str):
        self.path = Path(prefix)
        self.meta: dict = {}  # no bad rows recorded
        self._open()

    def _open(self) -> None:
        idx = np.memmap(str(self.path) + ".idx", dtype=np.uint8, mode="r")
        head = bytes(idx[:34])
        if len(head) < 34 or head[:9] != MEGATRON_HEADER:
            raise ConfigError(f"{self.path}.idx is not a Megatron-LM index (no MMIDIDX header)")
        version, code, num_seqs, num_docs = struct.unpack("<QBQQ", head[9:34])
        if version != 1 or code not in MEGATRON_DTYPES:
            raise ConfigError(f"{self.path}.idx: Megatron index version {version}, dtype {code}")
        self.dtype = np.dtype(MEGATRON_DTYPES[code])
        at = 34
        sizes = np.frombuffer(idx, np.int32, num_seqs, at)
        pointers = np.frombuffer(idx, np.int64, num_seqs, at + 4 * num_seqs)
        doc_idx = np.frombuffer(idx, np.int64, num_docs, at + 12 * num_seqs)
        self.tokens = np.memmap(str(self.path) + ".bin", dtype=self.dtype, mode="r")
        self.num_tokens = int(sizes.sum(dtype=np.int64))
        if num_seqs and int(pointers[-1]) // self.dtype.itemsize + int(sizes[-1]) != len(
            self.tokens
        ):
            raise ConfigError(f"{self.path}.bin does not hold the tokens its .idx describes")
        self._pointers, self._doc_idx = pointers, doc_idx  # views of the map: no copy
        self.num_docs = len(doc_idx) - 1

    def _doc_start(self, j: int) -> int:
        """Document j = sequences [doc_idx[j], doc_idx[j+1]), back to back as Megatron writes
        them: its tokens start at its first sequence's and end where the next document starts."""
        s = int(self._doc_idx[j])
        return (
            self.num_tokens
            if s == len(self._pointers)
            else int(self._pointers[s]) // (self.dtype.itemsize)
        )

    def __getstate__(self) -> dict:
        """Pickled for data workers started by spawn: the maps are opened again there."""
        return {"path": self.path, "meta": self.meta}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def document(self, i: int) -> np.ndarray:
        return self.tokens[self._doc_start(i) : self._doc_start(i + 1)]

    def token_range(self, start: int, stop: int) -> np.ndarray:
        return self.tokens[start:stop]


class ChainedTokens:
    """Several prepared parts back to back: documents and tokens numbered across them."""

    def __init__(self, path: str, pieces: list):
        self.path, self.pieces = path, pieces
        self._docs = np.cumsum([0] + [p.num_docs for p in pieces]).tolist()
        self._tokens = np.cumsum([0] + [p.num_tokens for p in pieces]).tolist()
        self.num_docs, self.num_tokens = self._docs[-1], self._tokens[-1]
        skipped = [p.meta for p in pieces if p.meta.get("skipped_rows")]
        self.meta = {"skipped_rows": sum(m["skipped_rows"] for m in skipped)}
        if skipped:
            self.meta["last_skipped_row"] = skipped[-1]["last_skipped_row"]

    def document(self, i: int) -> np.ndarray:
        k = bisect.bisect_right(self._docs, i) - 1
        return self.pieces[k].document(i - self._docs[k])

    def token_range(self, start: int, stop: int) -> np.ndarray:
        k, out = bisect.bisect_right(self._tokens, start) - 1, []
        while start < stop:
            end = min(stop, self._tokens[k + 1])
            base = self._tokens[k]
            out.append(self.pieces[k].token_range(start - base, end - base).astype(np.uint32))
            start, k = end, k + 1
        return out[0] if len(out) == 1 else np.concatenate(out)


def open_tokens(dataset_path: str, tokenizer):
    """The prepared parts of `dataset_path`, each store checked against this run's tokenizer."""
    pieces = [
        open_prepared(p, tokenizer) if is_store(p) else MegatronTokens(megatron_prefix(p))
        for p in parts(dataset_path)
    ]
    return pieces[0] if len(pieces) == 1 else ChainedTokens(dataset_path, pieces)
