"""Samples -> per-rank microbatches, with a global batch that does not depend on the dp split.

A sample is a window of seq_len + 1 tokens (packing) or one document cut to seq_len + 1 tokens (no
packing), read from the token cache (`titanlite.data.cache`). Training (`TrainLoader`): step k's
global batch is samples perm[k*G : (k+1)*G] of a per-epoch permutation seeded by (seed, epoch)
(`titanlite.data.shuffle`, evaluated per sample read);
dp rank r takes rows [r*G/D, (r+1)*G/D) and cuts them into microbatches. So the rows of step k
are the same for every (dp_degree, local_batch_size) with the same G, and the state is just the
global step. Validation (`ValidationLoader`): every sample of the split once, in order.

Streamed sources (hub datasets; local files with training.dataset_streaming) are sharded
instead (`_ShardStream`): dp rank r reads only its share of the stream,
`split_dataset_by_node(rank=r, world_size=D)` (whole files when the file count is a multiple of
D; otherwise every rank reads all files and keeps, so tokenizes, every D-th document), in stream
order with no shuffle; TP peers of a dp rank read the same share. Step k's rows on rank r are the
next G/D samples of r's share, so the global batch is the same for any local_batch_size at a
fixed dp degree, but not across dp degrees. The state adds each dp rank's stream position, taken
when the step is made (the prefetch thread is one step ahead): the dataset's `state_dict()` at
the start of the current tokenization chunk, the chunk's documents already used and the tokens
packing carries over. A resume re-reads that one chunk, however far into the stream it is (the
dataset itself skips to the position within the current file); it refuses another dp degree.
Validation streams are read whole, in order, by every rank.

Every batch is checked on the CPU as it is made: a token id outside the model's vocabulary stops
the run here, naming the values, instead of in a device-side assert in the embedding or the loss.
"""

import logging
import math
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from functools import partial
from itertools import count, islice

import numpy as np
import torch

from titanlite.config import ConfigError, DataLoader, Training, Validation
from titanlite.data import shuffle
from titanlite.data.cache import encode_documents, prepare_token_cache
from titanlite.data.sources import TextSource, build_source, local_source
from titanlite.data.store import TokenStore, is_store, open_prepared
from titanlite.data.workers import Microbatches, WorkerSteps
from titanlite.loss import IGNORE_INDEX

logger = logging.getLogger(__name__)

Microbatch = tuple[torch.Tensor, torch.Tensor]  # (tokens, labels), both [rows, seq_len] int64
_STREAM_DOCS_PER_CALL = 64  # fewer than the cache's 256: a hub stream's first batch comes sooner


def _window(store: TokenStore, w: int, i: int) -> np.ndarray:
    return store.token_range(i * w, (i + 1) * w)


def _document(store: TokenStore, n: int, i: int) -> np.ndarray:
    return store.document(i)[:n]


def _cached_samples(store: TokenStore, seq_len: int, packing: bool):
    """(get, count): get(i) is sample i of the store (a view; a copy if it spans two shards).
    `get` pickles (module functions, not lambdas) for workers started by spawn."""
    if packing:
        w = seq_len + 1  # windows do not overlap: the last label of one is not the next's input
        return partial(_window, store, w), store.num_tokens // w
    return partial(_document, store, seq_len + 1), store.num_docs


def _stream_samples(source: TextSource, tokenizer, seq_len: int, packing: bool):
    """Samples of a streamed source, tokenized on the fly with the same window logic."""
    buf: list[int] = []  # packing: tokens carried over into the next window
    for ids in encode_documents(source, tokenizer, _STREAM_DOCS_PER_CALL):
        if not packing:
            yield np.asarray(ids[: seq_len + 1], dtype=np.uint32)
            continue
        buf.extend(ids)
        while len(buf) >= seq_len + 1:
            yield np.asarray(buf[: seq_len + 1], dtype=np.uint32)
            del buf[: seq_len + 1]


def _check_ids(tokens: np.ndarray, labels: np.ndarray, vocab_size: int) -> None:
    # Inputs too, not only labels: the first token of a packed window is never a label.
    bad_tokens = (tokens < 0) | (tokens >= vocab_size)
    bad_labels = (labels >= vocab_size) | ((labels < 0) & (labels != IGNORE_INDEX))
    if bad_tokens.any() or bad_labels.any():
        values = np.unique(np.concatenate([tokens[bad_tokens], labels[bad_labels]]))
        raise ConfigError(
            f"token ids {values[:8].tolist()} are outside the model's vocabulary "
            f"[0, vocab_size={vocab_size}) (labels may also be {IGNORE_INDEX}); the tokenizer's "
            "vocabulary is likely larger than the model's vocab_size"
        )


def collate(rows: list[np.ndarray], seq_len: int, pad: int, vocab_size: int) -> Microbatch:
    """Rows of <= seq_len + 1 tokens -> (tokens, labels) [len(rows), seq_len] int64; short rows
    are right-padded with `pad` in tokens and IGNORE_INDEX in labels. Raises ValueError if an id
    is outside [0, vocab_size)."""
    tokens = np.full((len(rows), seq_len), pad, dtype=np.int64)
    labels = np.full((len(rows), seq_len), IGNORE_INDEX, dtype=np.int64)
    for i, w in enumerate(rows):
        n = max(len(w) - 1, 0)
        tokens[i, :n] = w[:-1]
        labels[i, :n] = w[1:]
    _check_ids(tokens, labels, vocab_size)
    return torch.from_numpy(tokens), torch.from_numpy(labels)


class _PermutedOrder:
    """Global sample positions -> cached samples, a fresh permutation each epoch (computed per
    position, titanlite.data.shuffle: no per-sample table, whatever the corpus size)."""

    def __init__(self, get, lo: int, hi: int, seed: int):
        self.get, self.lo, self.n, self.seed = get, lo, hi - lo, seed

    def take(self, start: int, stop: int) -> list[np.ndarray]:
        positions = np.arange(start, stop, dtype=np.int64)
        epochs, within = np.divmod(positions, self.n)
        samples = np.empty_like(positions)
        for epoch in np.unique(epochs):  # a batch spans at most two epochs
            at = epochs == epoch
            samples[at] = shuffle.permutation(self.n, self.seed, int(epoch))(within[at])
        return [self.get(self.lo + int(i)) for i in samples]


def _stream_start() -> dict:
    """The position of a stream that has not been read yet (see `_ShardStream`)."""
    return {"epoch": 0, "dataset": None, "skip": 0, "carry": np.empty(0, dtype=np.uint32)}


class _ShardStream:
    """One dp rank's share of a streamed source as samples (the cache's window logic), read in
    order and restarted at its end (a new epoch; a partial last window is dropped).

    Documents are tokenized `docs_per_chunk` at a time. `position()`, between two samples, is where
    the next one starts: the epoch, the dataset's `state_dict()` at the start of the current chunk,
    how many of the chunk's documents are used up, and the tokens packing carries over from them.
    `seek(position)` re-reads and re-tokenizes just that chunk, so resuming costs the same at any
    point of the stream."""

    def __init__(self, open_shard, texts, tokenizer, seq_len: int, packing: bool, docs_per_chunk):
        self.open_shard = open_shard  # () -> this rank's share, a fresh IterableDataset
        self.texts = texts  # IterableDataset -> its texts, one example at a time
        self.tokenizer, self.window, self.packing = tokenizer, seq_len + 1, packing
        self.docs_per_chunk = docs_per_chunk
        self.seek(_stream_start())

    def seek(self, position: dict) -> None:
        p = position
        self._epoch, self._chunk_state, self._used = p["epoch"], p["dataset"], p["skip"]
        self._buf, self._off = np.asarray(p["carry"], dtype=np.uint32), 0
        self._samples = self._read()

    def position(self) -> dict:
        carry = self._buf[self._off :].copy()
        return dict(epoch=self._epoch, dataset=self._chunk_state, skip=self._used, carry=carry)

    def take(self, n: int) -> list[np.ndarray]:
        return list(islice(self._samples, n))

    def _read(self) -> Iterator[np.ndarray]:
        while True:  # epochs
            ds, from_start = self.open_shard(), self._chunk_state is None
            if not from_start:
                ds.load_state_dict(self._chunk_state)
            texts, made = self.texts(ds), 0
            while chunk := list(islice(texts, self.docs_per_chunk)):
                next_chunk = ds.state_dict()  # the dataset has just read this chunk's last text
                docs = self.tokenizer.encode_batch(chunk[self._used :], bos=True, eos=True)
                for ids in docs:
                    self._used += 1
                    for sample in self._samples_of(ids):
                        made += 1
                        yield sample
                self._chunk_state, self._used = next_chunk, 0
            if from_start and made == 0:
                raise ConfigError(
                    "this data-parallel rank's share of the data stream produced no samples; "
                    "use more documents (or files) than data-parallel ranks"
                )
            self._epoch, self._chunk_state = self._epoch + 1, None
            self._buf, self._off = np.empty(0, dtype=np.uint32), 0

    def _samples_of(self, ids: list[int]) -> Iterator[np.ndarray]:
        """The samples document `ids` completes; with packing, what is left stays in the buffer
        (a new array, so samples already handed out, views of the old one, stay valid)."""
        w = self.window
        if not self.packing:
            yield np.asarray(ids[:w], dtype=np.uint32)
            return
        self._buf = np.concatenate([self._buf[self._off :], np.asarray(ids, dtype=np.uint32)])
        self._off = 0
        while len(self._buf) - self._off >= w:
            self._off += w
            yield self._buf[self._off - w : self._off]


class TrainLoader:
    """`next_step()` returns this rank's microbatches for the next global step; a background
    thread makes the step after it meanwhile, or with `dataloader.num_workers` > 0 worker
    processes make the next microbatches (`titanlite.data.workers`: same batches, bitwise). The
    state is the global step (plus what fixes the data order, checked on resume), so a run can
    resume under any dp split and any worker count. A sharded stream adds this dp rank's stream
    position (`stream_state_dict()`), which resumes only under the same dp degree."""

    def __init__(
        self,
        order: "_PermutedOrder | _ShardStream",
        make_batch: Callable[[list[np.ndarray]], Microbatch],
        *,
        dp_rank: int,
        dp_degree: int,
        local_batch_size: int,
        num_microbatches: int,
        order_state: dict,
        dataloader: DataLoader,
    ):
        self.order, self.make_batch = order, make_batch
        self.dp_rank, self.dp_degree, self.local_batch_size = dp_rank, dp_degree, local_batch_size
        self.num_microbatches = num_microbatches
        # seed, seq_len, global_batch_size, packing, num_samples, shuffle, fingerprint: saved
        # with the step
        self._order_state = order_state
        self.global_batch_size = order_state["global_batch_size"]
        self.num_samples = order_state["num_samples"]  # -1 for a stream
        self.sharded = isinstance(order, _ShardStream)
        # A sharded stream's position after the last step the trainer consumed.
        self._position = order.position() if self.sharded else None
        self._pin = dataloader.pin_memory and torch.cuda.is_available()
        self._step = 0  # the next global step the trainer will consume
        self._pending = None  # (step, Future) prepared by the background thread
        # Starts its thread on the first submit: none with workers.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="titanlite-data")
        self._workers = None
        if dataloader.num_workers > 0:
            assert not self.sharded, "build_train_loader refuses workers for a stream"
            items = Microbatches(
                order, make_batch, global_batch_size=self.global_batch_size,
                rank_start=dp_rank * num_microbatches * local_batch_size,
                local_batch_size=local_batch_size,
            )  # fmt: skip
            self._workers = WorkerSteps(items, num_microbatches, dataloader, self._pin)

    def _rows(self, step: int) -> list[np.ndarray]:
        per_rank = self.num_microbatches * self.local_batch_size
        if self.sharded:  # the next rows of this rank's own share of the stream
            return self.order.take(per_rank)
        start = step * self.global_batch_size + self.dp_rank * per_rank  # its slice of the step
        return self.order.take(start, start + per_rank)

    def _produce(self, step: int) -> tuple[list[Microbatch], dict | None]:
        rows = self._rows(step)
        # Snapshot here: when the trainer takes this step, this thread is already making the next.
        position = self.order.position() if self.sharded else None
        out = []
        lb = self.local_batch_size
        for mb in range(self.num_microbatches):
            tok, lab = self.make_batch(rows[mb * lb : (mb + 1) * lb])
            out.append((tok.pin_memory(), lab.pin_memory()) if self._pin else (tok, lab))
        return out, position

    def next_step(self) -> list[Microbatch]:
        step = self._step
        if self._workers is not None:
            batches = self._workers.take(step)
        else:
            if self._pending is None or self._pending[0] != step:
                self._pending = (step, self._executor.submit(self._produce, step))
            batches, self._position = self._pending[1].result()
            self._pending = (step + 1, self._executor.submit(self._produce, step + 1))
        self._step = step + 1
        return batches

    def state_dict(self) -> dict:
        return {"step": self._step, **self._order_state}

    def stream_state_dict(self) -> dict | None:
        """This dp rank's stream position after the last step consumed (TP peers of a dp rank
        have equal ones); None when the data is not a sharded stream (the position is global)."""
        if not self.sharded:
            return None
        return {"dp_rank": self.dp_rank, "dp_degree": self.dp_degree, **self._position}

    def load_state_dict(self, sd: dict, stream: dict | None = None) -> None:
        """Resume at `sd` (global); a sharded stream also needs its `stream_state_dict()`."""
        mine = self.state_dict()
        keys = ("seed", "seq_len", "global_batch_size", "packing", "num_samples", "shuffle")
        bad = [
            f"{k}: checkpoint {sd.get(k)!r} vs now {mine[k]!r}"
            for k in keys
            if sd.get(k) != mine[k]
        ]
        if bad:
            raise ConfigError(
                "cannot resume the data loader: the data order would differ ("
                + "; ".join(bad)
                + "). Use the same training config and data, or restart the data from its first "
                "batch with --checkpoint.exclude_from_loading dataloader."
            )
        if sd.get("fingerprint") != mine["fingerprint"]:
            # Same sample count and layout; files were only touched or copied (mtimes changed).
            logger.warning("data fingerprint changed since the checkpoint; resuming anyway")
        if self.sharded:
            self._seek(stream)
        self._step = int(sd["step"])

    def _seek(self, stream: dict | None) -> None:
        if stream is None:
            raise ConfigError(
                "cannot resume the data stream: the checkpoint holds no stream position for dp "
                f"rank {self.dp_rank}. Restart the data from its first batch with "
                "--checkpoint.exclude_from_loading dataloader."
            )
        saved = (stream["dp_rank"], stream["dp_degree"])
        if saved != (self.dp_rank, self.dp_degree):
            raise ConfigError(dp_degree_changed(stream["dp_degree"], self.dp_degree))
        if self._pending is not None and not self._pending[1].cancel():
            wait([self._pending[1]])  # it is reading on from the old position: let it finish
        self._pending = None
        self.order.seek(stream)
        self._position = self.order.position()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._pending = None
        if self._workers is not None:
            self._workers.close()


def dp_degree_changed(saved: int, now: int) -> str:
    """The error for resuming a sharded stream under another dp degree."""
    return (
        f"cannot resume the data stream: it was saved with data-parallel degree {saved}, this run "
        f"has {now}, and each dp rank read its own share of the stream (its position is per "
        "rank). Resume with the same data_parallel_replicate_degree x data_parallel_shard_degree, "
        "or restart the data from its first batch with --checkpoint.exclude_from_loading "
        "dataloader."
    )


class ValidationLoader:
    """`iter_batches()` covers the split once, in order, in the calling thread (validation runs
    rarely, so a prefetch thread would only hold memory); there is nothing to close."""

    def __init__(
        self,
        samples: Callable[[], Iterator[np.ndarray]],
        make_batch,
        *,
        dp_rank: int,
        dp_degree: int,
        local_batch_size: int,
        num_samples: int,
    ):
        self.samples, self.make_batch = samples, make_batch
        self.dp_rank, self.dp_degree, self.local_batch_size = dp_rank, dp_degree, local_batch_size
        self.num_samples = num_samples  # -1 for a stream

    def iter_batches(self, steps: int = -1) -> Iterator[Microbatch]:
        """Each sample once, in order, in global batches of local_batch_size x D rows (rank r
        takes its slice); the last batch is padded with all-ignored rows so every rank runs the
        same number of forwards. At most `steps` batches when steps > 0."""
        lb, g = self.local_batch_size, self.local_batch_size * self.dp_degree
        samples = iter(self.samples())
        for i in count():
            rows = [] if 0 < steps <= i else list(islice(samples, g))
            if not rows:
                return
            rows += [np.empty(0, dtype=np.uint32)] * (g - len(rows))
            yield self.make_batch(rows[self.dp_rank * lb : (self.dp_rank + 1) * lb])


def _source(training: Training, validation: Validation, split: str) -> TextSource:
    if split == "validation" and validation.dataset_path:
        return local_source(validation.dataset_path, training.dataset_text_column)
    t = training
    return build_source(
        t.dataset, t.dataset_path, t.dataset_text_column, split, t.dataset_streaming
    )


def _cached_split(source, tokenizer, training: Training, validation: Validation, split: str):
    """(get, lo, hi): cached samples [lo, hi) are `split`. Without validation.dataset_path the
    last holdout_fraction of the samples is validation, and training never sees it."""
    own_val = split == "validation" and validation.dataset_path
    path = validation.dataset_path if own_val else training.dataset_path
    if is_store(path):  # prepared by scripts/prepare_data.py: no tokenizing at run time
        cache = open_prepared(path, tokenizer)
    else:
        t = training
        cache = prepare_token_cache(source, tokenizer, t.data_cache_dir, t.data_build_timeout_s)
    get, total = _cached_samples(cache, training.seq_len, training.packing)
    if validation.dataset_path:  # validation has its own files: each split is its whole source
        return get, 0, total
    held_out = math.ceil(total * validation.holdout_fraction)
    return (get, total - held_out, total) if split == "validation" else (get, 0, total - held_out)


def _batch_maker(training: Training, tokenizer, vocab_size: int):
    return partial(collate, seq_len=training.seq_len, pad=tokenizer.eos_id, vocab_size=vocab_size)


def _check_rank(dp_rank: int, dp_degree: int) -> None:
    if not 0 <= dp_rank < dp_degree:
        raise ValueError(f"dp_rank {dp_rank} out of range for dp_degree {dp_degree}")


def _shard_stream(source: TextSource, tokenizer, t: Training, dp_rank: int, dp_degree: int):
    """This dp rank's share of a streamed source (TP peers read the same share)."""
    from datasets.distributed import split_dataset_by_node  # heavy: only for streams

    stream = source.stream
    num_files = stream.open().n_shards
    if num_files % dp_degree == 0:
        logger.info(
            "streaming %s: each of %d dp ranks reads %d of its %d files",
            source.name, dp_degree, num_files // dp_degree, num_files,
        )  # fmt: skip
    else:
        logger.info(
            "streaming %s: %d files do not split evenly over %d dp ranks, so every rank reads "
            "all of them and tokenizes every %d-th document; a multiple of %d files (shards) "
            "would let each rank read only its own",
            source.name, num_files, dp_degree, dp_degree, dp_degree,
        )  # fmt: skip

    def open_shard():
        return split_dataset_by_node(stream.open(), rank=dp_rank, world_size=dp_degree)

    return _ShardStream(
        open_shard, stream.texts, tokenizer, t.seq_len, t.packing, _STREAM_DOCS_PER_CALL
    )


def build_train_loader(
    training: Training,
    tokenizer,
    *,
    dp_rank: int,
    dp_degree: int,
    global_batch_size: int,
    num_microbatches: int,
    vocab_size: int,
    seed: int,
    validation: Validation | None = None,
) -> TrainLoader:
    """The training loader of one dp rank. `global_batch_size` and `num_microbatches` are
    `titanlite.checks.resolve_global_batch(training, dp_degree)`; `vocab_size` is the model's;
    `seed` orders the samples.
    `validation` decides what is held out (None: its defaults, the same holdout as a run with
    validation on, so switching validation on does not change the training data)."""
    t, val = training, validation or Validation()
    _check_rank(dp_rank, dp_degree)
    per_rank = num_microbatches * t.local_batch_size  # as resolve_global_batch split it
    assert global_batch_size == per_rank * dp_degree, (global_batch_size, per_rank, dp_degree)
    source = _source(t, val, "train")
    if source.streaming and t.dataloader.num_workers > 0:
        raise ConfigError(
            "training.dataloader.num_workers > 0 needs a token store: a streamed source is "
            "tokenized in order by one reader whose exact position each checkpoint saves, which "
            "worker processes cannot share; prepare the data with scripts/prepare_data.py and "
            "train from that directory, or set num_workers 0"
        )
    if source.streaming:
        order, num_samples = _shard_stream(source, tokenizer, t, dp_rank, dp_degree), -1
    else:
        get, lo, hi = _cached_split(source, tokenizer, t, val, "train")
        num_samples = hi - lo
        if num_samples < global_batch_size:
            raise ConfigError(
                f"the training split has {num_samples} samples, fewer than one global batch "
                f"({global_batch_size}); use more data, a smaller seq_len or a smaller "
                "global_batch_size"
            )
        order = _PermutedOrder(get, lo, hi, seed)
    order_state = dict(
        seed=seed,
        seq_len=t.seq_len,
        global_batch_size=global_batch_size,
        packing=t.packing,
        num_samples=num_samples,
        shuffle="stream order" if source.streaming else shuffle.NAME,
        fingerprint=source.fingerprint,
    )
    return TrainLoader(
        order,
        _batch_maker(t, tokenizer, vocab_size),
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        local_batch_size=t.local_batch_size,
        num_microbatches=num_microbatches,
        order_state=order_state,
        dataloader=t.dataloader,
    )


def build_validation_loader(
    training: Training,
    validation: Validation,
    tokenizer,
    *,
    dp_rank: int,
    dp_degree: int,
    vocab_size: int,
) -> ValidationLoader:
    """The validation loader of one dp rank: validation.dataset_path if set, else the held-out
    end of the training source (the hub's validation split for a streamed dataset)."""
    t, val = training, validation
    _check_rank(dp_rank, dp_degree)
    source = _source(t, val, "validation")
    if source.streaming:
        samples, num_samples = partial(_stream_samples, source, tokenizer, t.seq_len, t.packing), -1
    else:
        get, lo, hi = _cached_split(source, tokenizer, t, val, "validation")
        if hi <= lo:
            raise ConfigError(
                "validation has no samples: set validation.holdout_fraction > 0 "
                f"(now {val.holdout_fraction}) or validation.dataset_path"
            )
        samples, num_samples = partial(map, get, range(lo, hi)), hi - lo
    lb = val.local_batch_size if val.local_batch_size > 0 else t.local_batch_size
    return ValidationLoader(
        samples,
        _batch_maker(t, tokenizer, vocab_size),
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        local_batch_size=lb,
        num_samples=num_samples,
    )
