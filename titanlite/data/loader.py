"""Token stream -> per-rank microbatches, with a global batch that does not depend on the dp split.

Local sources are tokenized once into a memory-mapped cache (see `prepare_token_cache`). A sample
is a window of seq_len + 1 tokens (packing) or one document (no packing). Step k's global batch is
samples perm[k*G : (k+1)*G] of a per-epoch permutation seeded by (seed, epoch); dp rank r takes
rows [r*G/D, (r+1)*G/D) and cuts them into microbatches. So the rows of step k are the same for
every (dp_degree, local_batch_size) with the same G, and the state is just the global step.

Hub datasets are streamed instead: every rank reads and tokenizes the same stream (in stream
order, no shuffle) and keeps only its rows, so the same invariance holds.
"""

import hashlib
import json
import logging
import math
import os
import shutil
import time
import uuid
from array import array
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from pathlib import Path

import numpy as np
import torch

from titanlite.data.sources import TextSource, build_source, local_source

logger = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1
IGNORE_INDEX = -100
DEFAULT_HOLDOUT = 0.01  # validation.holdout_fraction's default, for callers that pass no section
_DOCS_PER_CHUNK = 256  # documents per encode_batch call: enough to keep all cores busy


def cache_root(data_cache_dir: str = "") -> Path:
    return Path(
        data_cache_dir or os.environ.get("TITANLITE_CACHE") or "~/.cache/titanlite"
    ).expanduser()


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


def _chunks(it, n: int) -> Iterator[list]:
    it = iter(it)
    while chunk := list(islice(it, n)):
        yield chunk


def _build_cache(source: TextSource, tokenizer, final: Path) -> None:
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        start, offsets = time.perf_counter(), array("q", [0])  # 8 bytes/doc, not a PyObject
        with open(tmp / "tokens.bin", "wb") as f:
            for docs in _chunks(source.documents(), _DOCS_PER_CHUNK):
                for ids in tokenizer.encode_batch(docs, bos=True, eos=True):
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


def _cached_samples(cache: TokenCache, seq_len: int, packing: bool):
    """(get, count): get(i) is sample i of the cache (a view, no copy)."""
    if packing:
        w = seq_len + 1  # windows do not overlap: the last label of one is not the next's input
        return (lambda i: cache.tokens[i * w : (i + 1) * w]), len(cache.tokens) // w
    o = cache.offsets
    return (lambda i: cache.tokens[o[i] : min(o[i + 1], o[i] + seq_len + 1)]), cache.num_docs


def _stream_samples(source: TextSource, tokenizer, seq_len: int, packing: bool):
    """Samples of a streamed source, tokenized on the fly with the same window logic."""
    buf: list[int] = []  # packing: tokens carried over into the next window
    for docs in _chunks(source.documents(), 64):
        for ids in tokenizer.encode_batch(docs, bos=True, eos=True):
            if not packing:
                yield np.asarray(ids[: seq_len + 1], dtype=np.uint32)
                continue
            buf.extend(ids)
            while len(buf) >= seq_len + 1:
                yield np.asarray(buf[: seq_len + 1], dtype=np.uint32)
                del buf[: seq_len + 1]


def collate(rows: list[np.ndarray], seq_len: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of <= seq_len + 1 tokens -> (tokens, labels) [len(rows), seq_len] int64; short rows
    are right-padded with `pad` in tokens and IGNORE_INDEX in labels."""
    tokens = np.full((len(rows), seq_len), pad, dtype=np.int64)
    labels = np.full((len(rows), seq_len), IGNORE_INDEX, dtype=np.int64)
    for i, w in enumerate(rows):
        n = max(len(w) - 1, 0)
        tokens[i, :n] = w[:-1]
        labels[i, :n] = w[1:]
    return torch.from_numpy(tokens), torch.from_numpy(labels)


class _PermutedOrder:
    """Global sample positions -> cached samples, a fresh permutation each epoch."""

    def __init__(self, get, lo: int, hi: int, seed: int):
        self.get, self.lo, self.n, self.seed = get, lo, hi - lo, seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a batch spans at most two epochs
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._perms[epoch]

    def take(self, start: int, stop: int) -> list[np.ndarray]:
        return [
            self.get(self.lo + int(self._perm(p // self.n)[p % self.n])) for p in range(start, stop)
        ]


class _StreamOrder:
    """Global sample positions -> samples of a stream read in order, restarted each epoch."""

    def __init__(self, make_iter: Callable[[], Iterator[np.ndarray]]):
        self.make_iter, self._it, self._pos = make_iter, None, 0

    def _epochs(self):
        while True:
            empty = True
            for sample in self.make_iter():
                empty = False
                yield sample
            if empty:
                raise ValueError("the data stream produced no samples")

    def take(self, start: int, stop: int) -> list[np.ndarray]:
        if self._it is None or start < self._pos:  # resumed behind the cursor: replay from 0
            self._it, self._pos = self._epochs(), 0
        rows = list(islice(self._it, start - self._pos, stop - self._pos))
        self._pos = stop
        return rows


class DataLoader:
    """Training: `next_step()` returns this rank's microbatches for the next global step, built
    in a background thread one step ahead. Validation: `iter_batches()` covers the split once."""

    def __init__(
        self,
        order,
        *,
        split,
        num_samples,
        dp_rank,
        dp_degree,
        local_batch_size,
        global_batch_size,
        seq_len,
        seed,
        packing,
        pad,
        fingerprint,
        val_samples=None,
    ):
        self.order, self.split, self.num_samples = order, split, num_samples
        self.dp_rank, self.dp_degree, self.local_batch_size = dp_rank, dp_degree, local_batch_size
        self.global_batch_size, self.seq_len, self.seed = global_batch_size, seq_len, seed
        self.packing, self.pad, self.fingerprint = packing, pad, fingerprint
        self._val_samples = val_samples  # callable -> iterator over the split, once
        self.num_microbatches = global_batch_size // (dp_degree * local_batch_size)
        self._pin = torch.cuda.is_available()
        self._step = 0  # the next global step the trainer will consume
        self._pending = None  # (step, Future) prepared by the background thread
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="titanlite-data")

    def _produce(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        per_rank = self.global_batch_size // self.dp_degree
        start = step * self.global_batch_size + self.dp_rank * per_rank
        rows = self.order.take(start, start + per_rank)
        out = []
        for mb in range(self.num_microbatches):
            part = rows[mb * self.local_batch_size : (mb + 1) * self.local_batch_size]
            tok, lab = collate(part, self.seq_len, self.pad)
            out.append((tok.pin_memory(), lab.pin_memory()) if self._pin else (tok, lab))
        return out

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.split != "train":
            raise TypeError("next_step() is for the training loader; use iter_batches()")
        step = self._step
        if self._pending is None or self._pending[0] != step:
            self._pending = (step, self._executor.submit(self._produce, step))
        batches = self._pending[1].result()
        self._step = step + 1
        self._pending = (step + 1, self._executor.submit(self._produce, step + 1))
        return batches

    def iter_batches(self, steps: int = -1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Validation: each sample once, in order, in global batches of local_batch_size x D rows
        (rank r takes its slice); the last batch is padded with all-ignored rows so every rank
        runs the same number of forwards. At most `steps` batches when steps > 0."""
        if self._val_samples is None:
            raise TypeError("iter_batches() is for the validation loader; use next_step()")
        lb, g = self.local_batch_size, self.local_batch_size * self.dp_degree
        for i, rows in enumerate(_chunks(self._val_samples(), g)):
            if 0 < steps <= i:
                return
            rows += [np.empty(0, dtype=np.uint32)] * (g - len(rows))
            yield collate(rows[self.dp_rank * lb : (self.dp_rank + 1) * lb], self.seq_len, self.pad)

    def __iter__(self):
        return self.iter_batches()

    def state_dict(self) -> dict:
        return {
            "step": self._step,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "packing": self.packing,
            "num_samples": self.num_samples,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, sd: dict) -> None:
        mine = self.state_dict()
        keys = ("seed", "seq_len", "global_batch_size", "packing", "num_samples")
        bad = [
            f"{k}: checkpoint {sd.get(k)!r} vs now {mine[k]!r}"
            for k in keys
            if sd.get(k) != mine[k]
        ]
        if bad:
            raise ValueError(
                "cannot resume the data loader: the data order would differ ("
                + "; ".join(bad)
                + "). Use the same training config and data, or restart the data from its first "
                "batch with --checkpoint.exclude_from_loading dataloader."
            )
        if sd.get("fingerprint") != self.fingerprint:
            # Same sample count and layout; files were only touched or copied (mtimes changed).
            logger.warning("data fingerprint changed since the checkpoint; resuming anyway")
        self._step = int(sd["step"])

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._pending = None


def _check_batch(g: int, d: int, lb: int, num_samples: int | None) -> None:
    if g <= 0 or g % (d * lb):
        raise ValueError(
            f"training.global_batch_size ({g}) must be a positive multiple of "
            f"training.local_batch_size ({lb}) x dp degree ({d}) = {d * lb}; e.g. set "
            f"global_batch_size to {max(1, round(g / (d * lb))) * d * lb} or -1"
        )
    if num_samples is not None and num_samples < g:
        raise ValueError(
            f"the training split has {num_samples} samples, fewer than one global batch ({g}); "
            "use more data, a smaller seq_len or a smaller global_batch_size"
        )


def build_dataloader(training_cfg, tokenizer, dp_rank: int, dp_degree: int, split: str = "train",
                     validation_cfg=None) -> DataLoader:  # fmt: skip
    """The loader for one dp rank. Without `validation.dataset_path` the last holdout_fraction of
    the samples is validation and training never sees it (holdout_fraction defaults to 0.01 when
    no validation section is passed, so training data does not change when validation is on)."""
    t, val = training_cfg, validation_cfg
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    if not 0 <= dp_rank < dp_degree:
        raise ValueError(f"dp_rank {dp_rank} out of range for dp_degree {dp_degree}")
    val_path = val.dataset_path if val is not None else ""
    holdout = 0.0 if val_path else (val.holdout_fraction if val is not None else DEFAULT_HOLDOUT)
    lb = t.local_batch_size
    if split == "validation" and val is not None and val.local_batch_size > 0:
        lb = val.local_batch_size
    g = t.global_batch_size if t.global_batch_size > 0 else lb * dp_degree
    if split == "validation" and val_path:
        source = local_source(val_path, t.dataset_text_column)
    else:
        source = build_source(t.dataset, t.dataset_path, t.dataset_text_column, split)
    common = dict(split=split, dp_rank=dp_rank, dp_degree=dp_degree, local_batch_size=lb,
                  global_batch_size=g, seq_len=t.seq_len, seed=t.seed, packing=t.packing,
                  pad=tokenizer.eos_id, fingerprint=source.fingerprint)  # fmt: skip

    if source.streaming:
        samples = lambda: _stream_samples(source, tokenizer, t.seq_len, t.packing)
        if split == "validation":
            return DataLoader(None, num_samples=-1, val_samples=samples, **common)
        _check_batch(g, dp_degree, lb, None)
        return DataLoader(_StreamOrder(samples), num_samples=-1, **common)

    cache = prepare_token_cache(source, tokenizer, t.data_cache_dir)
    get, total = _cached_samples(cache, t.seq_len, t.packing)
    num_val = math.ceil(total * holdout)  # holdout is 0 when validation has its own files
    if split == "validation":
        lo = 0 if val_path else total - num_val
        if total - lo <= 0:
            raise ValueError(
                "validation has no samples: set validation.holdout_fraction > 0 "
                f"(now {holdout}) or validation.dataset_path"
            )
        return DataLoader(
            None, num_samples=total - lo, val_samples=lambda: map(get, range(lo, total)), **common
        )
    _check_batch(g, dp_degree, lb, total - num_val)
    order = _PermutedOrder(get, 0, total - num_val, t.seed)
    return DataLoader(order, num_samples=total - num_val, **common)
