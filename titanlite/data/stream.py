"""Streamed sources (hub datasets; local files with training.dataset_streaming), tokenized on the
fly by the loader.

Training shards a stream instead of shuffling it (`ShardStream`): dp rank r reads only its share,
`split_dataset_by_node(rank=r, world_size=D)` (whole files when the file count is a multiple of
D; otherwise every rank reads all files and keeps, so tokenizes, every D-th document), in stream
order with no shuffle; TP peers of a dp rank read the same share. Step k's rows on rank r are the
next G/D samples of r's share, so the global batch is the same for any local_batch_size at a
fixed dp degree, but not across dp degrees. The loader's state adds each dp rank's stream
position, taken when the step is made (the prefetch thread is one step ahead): the dataset's
`state_dict()` at the start of the current tokenization chunk, the chunk's documents already
used, the tokens packing carries over, and the bad rows skipped before the chunk and through it
(with training.dataset_max_bad_rows: a rank's share counts its own, on the first pass, and a
D-th row kept by a rank may be a bad one). A resume re-reads that one chunk, however far into the
stream it is (the dataset itself skips to the position within the current file); it refuses
another dp degree.

Validation streams are read whole, in order, by every rank (`validation_samples`).
"""

import logging
from collections.abc import Iterator
from itertools import islice

import numpy as np

from titanlite.config import ConfigError
from titanlite.data.diagnose import SkippedRows
from titanlite.data.packing import Packer
from titanlite.data.sources import DocumentStream, TextSource

logger = logging.getLogger(__name__)

DOCS_PER_CALL = 64  # documents per encode_batch call: few, so a hub stream's first batch comes soon


def stream_start() -> dict:
    """The position of a stream that has not been read yet (see `ShardStream`)."""
    carry = np.empty(0, dtype=np.uint32)
    return dict(epoch=0, dataset=None, skip=0, carry=carry, skipped_rows=0, chunk_skipped_rows=0)


class ShardStream:
    """One dp rank's share of a streamed source as samples (`titanlite.data.packing`), read in
    order and restarted at its end (a new epoch; a partial last window is dropped).

    Documents are tokenized `docs_per_chunk` at a time. `position()`, between two samples, is where
    the next one starts: the epoch, the dataset's `state_dict()` at the start of the current chunk,
    how many of the chunk's documents are used up, and the tokens packing carries over from them.
    `seek(position)` re-reads and re-tokenizes just that chunk, so resuming costs the same at any
    point of the stream."""

    def __init__(self, open_shard, stream: DocumentStream, tokenizer, seq_len: int, packing: bool):
        self.open_shard = open_shard  # () -> this rank's share, a fresh IterableDataset
        self.texts = stream.texts  # (IterableDataset, SkippedRows) -> texts, one at a time
        self.tokenizer, self.seq_len, self.packing = tokenizer, seq_len, packing
        self.skipped = SkippedRows(stream.max_bad_rows)
        self.seek(stream_start())

    def seek(self, position: dict, row: int = 0) -> None:
        """Continue at `position`, which is row `row` of this share."""
        p = position
        self._epoch, self._chunk_state, self._used = p["epoch"], p["dataset"], p["skip"]
        self._packer = Packer(self.seq_len, self.packing, p["carry"])
        # The count before the chunk: reading it again counts its bad rows again.
        self.skipped.count = self._chunk_skipped = p.get("chunk_skipped_rows", 0)  # older: 0
        self._row, self._samples = row, self._read()

    def position(self) -> dict:
        carry = self._packer.carry()
        return dict(
            epoch=self._epoch, dataset=self._chunk_state, skip=self._used, carry=carry,
            skipped_rows=self.skipped.count, chunk_skipped_rows=self._chunk_skipped,
        )  # fmt: skip

    def take(self, start: int, stop: int) -> list[np.ndarray]:
        """Rows [start, stop) of this share: a stream is read forward, so the next ones."""
        assert start == self._row, f"the stream is at row {self._row}, not {start}"
        self._row = stop
        return list(islice(self._samples, stop - start))

    def epoch(self) -> Iterator[np.ndarray]:
        """The samples from the current position to the end of the share."""
        ds = self.open_shard()
        if self._chunk_state is not None:
            ds.load_state_dict(self._chunk_state)
        # A later pass meets again the bad rows that the first one counted.
        texts = self.texts(ds, self.skipped if self._epoch == 0 else None)
        while chunk := list(islice(texts, DOCS_PER_CALL)):
            # The dataset has just read this chunk's last text.
            next_chunk, next_skipped = ds.state_dict(), self.skipped.count
            for ids in self.tokenizer.encode_batch(chunk[self._used :], bos=True, eos=True):
                self._used += 1
                yield from self._packer.samples(ids)
            self._chunk_state, self._used, self._chunk_skipped = next_chunk, 0, next_skipped

    def _read(self) -> Iterator[np.ndarray]:
        while True:  # epochs
            from_start, made = self._chunk_state is None, 0
            for sample in self.epoch():
                made += 1
                yield sample
            if from_start and made == 0:
                raise ConfigError(
                    "this data-parallel rank's share of the data stream produced no samples; "
                    "use more documents (or files) than data-parallel ranks"
                )
            self._epoch, self._chunk_state = self._epoch + 1, None
            self._packer = Packer(self.seq_len, self.packing)


def shard_stream(source: TextSource, tokenizer, seq_len: int, packing: bool, dp_rank, dp_degree):
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

    return ShardStream(open_shard, stream, tokenizer, seq_len, packing)


def validation_samples(stream: DocumentStream, tokenizer, seq_len: int, packing: bool):
    """The samples of a whole stream, once, in order."""
    return ShardStream(stream.open, stream, tokenizer, seq_len, packing).epoch()


def dp_degree_changed(saved: int, now: int) -> str:
    """The error for resuming a sharded stream under another dp degree."""
    return (
        f"cannot resume the data stream: it was saved with data-parallel degree {saved}, this run "
        f"has {now}, and each dp rank read its own share of the stream (its position is per "
        "rank). Resume with the same data_parallel_replicate_degree x data_parallel_shard_degree, "
        "or restart the data from its first batch with --checkpoint.exclude_from_loading "
        "dataloader."
    )
