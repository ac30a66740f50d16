"""Samples -> per-rank microbatches, with a global batch that does not depend on the dp split.

A sample is a window of seq_len + 1 tokens (packing) or one document cut to seq_len + 1 tokens (no
packing), read from the token cache (`titanlite.data.cache`; `titanlite.data.packing`). Training
(`TrainLoader`): step k's global batch is samples perm[k*G : (k+1)*G] of a per-epoch permutation
seeded by (seed, epoch) (`titanlite.data.shuffle`, evaluated per sample read); dp rank r takes
rows [r*G/D, (r+1)*G/D) and cuts them into microbatches (`titanlite.data.order`). So the rows of
step k are the same for every (dp_degree, local_batch_size) with the same G, and the state is just
the global step. Validation (`ValidationLoader`): every sample of the split once, in order.

Streamed sources are sharded over the dp ranks instead, and their state adds each dp rank's
stream position (`titanlite.data.stream`).

With training.dataset_max_bad_rows, bad rows of local files are left out as they are read, so
the samples are the good rows' whatever the parallelism: a corpus tokenized into a store records
how many (refused here if more than this run allows), a stream counts them in its position.
"""

import hashlib
import json
import logging
import math
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from functools import partial
from itertools import count, islice

import numpy as np
import torch

from titanlite.config import ConfigError, DataLoader, Training, Validation
from titanlite.data import shuffle
from titanlite.data.cache import prepare_token_cache
from titanlite.data.diagnose import check_skipped
from titanlite.data.mixture import MixtureOrder, Part, stage_weights
from titanlite.data.order import Microbatches, PermutedOrder, microbatch_rows
from titanlite.data.packing import Microbatch, cached_samples, collate
from titanlite.data.prepared import is_prepared, open_tokens
from titanlite.data.sources import TextSource, build_source, local_source
from titanlite.data.stream import ShardStream, dp_degree_changed, shard_stream, validation_samples
from titanlite.data.workers import WorkerSteps

logger = logging.getLogger(__name__)


class TrainLoader:
    """`next_step()` returns this rank's microbatches for the next global step; a background
    thread makes the step after it meanwhile, or with `dataloader.num_workers` > 0 worker
    processes make the next microbatches (`titanlite.data.workers`: same batches, bitwise). The
    state is the global step (plus what fixes the data order, checked on resume), so a run can
    resume under any dp split and any worker count. A sharded stream adds this dp rank's stream
    position (`stream_state_dict()`), which resumes only under the same dp degree."""

    def __init__(
        self,
        order: PermutedOrder | ShardStream,
        make_batch: Callable[[list[np.ndarray]], Microbatch],
        *,
        dp_rank: int,
        dp_degree: int,
        local_batch_size: int,
        num_microbatches: int,
        order_state: dict,
        dataloader: DataLoader,
        skipped_rows: int | None = None,
    ):
        self.order, self.make_batch = order, make_batch
        self._skipped_rows = skipped_rows  # the store's; for a stream 0, its position then counts
        self.dp_rank, self.dp_degree, self.local_batch_size = dp_rank, dp_degree, local_batch_size
        self.num_microbatches = num_microbatches
        # seed, seq_len, global_batch_size, packing, num_samples, shuffle, fingerprint: saved
        # with the step
        self._order_state = order_state
        self.global_batch_size = order_state["global_batch_size"]
        self.num_samples = order_state["num_samples"]  # -1 for a stream
        self.sharded = isinstance(order, ShardStream)
        # A sharded stream's rows count this rank's own share, as if it were dp rank 0 of 1.
        share = (0, 1) if self.sharded else (dp_rank, dp_degree)
        self._items = Microbatches(
            order, make_batch, dp_rank=share[0], dp_degree=share[1],
            num_microbatches=num_microbatches, local_batch_size=local_batch_size,
        )  # fmt: skip
        # A sharded stream's position after the last step the trainer consumed.
        self._position = order.position() if self.sharded else None
        self._pin = dataloader.pin_memory and torch.cuda.is_available()
        self._step = 0  # the next global step the trainer will consume
        self._tally = None  # a mixture's own walker for source_tokens()
        self._rows_walk = None  # ... and one for its rows' sources (`_row_sources`)
        self._sources = None  # the row sources of the last step consumed
        self._pending = None  # (step, Future) prepared by the background thread
        # Starts its thread on the first submit: none with workers.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="titanlite-data")
        self._workers = None
        if dataloader.num_workers > 0:
            assert not self.sharded, "build_train_loader refuses workers for a stream"
            self._workers = WorkerSteps(self._items, dataloader, self._pin)

    def _produce(self, step: int) -> tuple[list[Microbatch], dict | None, list | None]:
        batches = [self._items[step, i] for i in range(self.num_microbatches)]
        # Snapshot here: when the trainer takes this step, this thread is already making the next.
        position = self.order.position() if self.sharded else None
        if self._pin:
            batches = [(tok.pin_memory(), lab.pin_memory()) for tok, lab in batches]
        return batches, position, self._row_sources(step)

    def _row_sources(self, step: int) -> list[torch.Tensor] | None:
        """A mixture's source index of each row of this rank's microbatches of `step`, from the
        blend (a function of the position); None without a mixture. Its own walker: the
        trainer's thread walks `_tally` meanwhile, and a walk sent back restarts from 0."""
        if not isinstance(self.order, MixtureOrder):
            return None
        if self._rows_walk is None:
            self._rows_walk = self.order.walker()
        rows = (self._items.rows(step, i) for i in range(self.num_microbatches))
        return [torch.from_numpy(self._rows_walk.sources(*r)) for r in rows]

    def next_step(self) -> list[Microbatch]:
        step = self._step
        if self._workers is not None:
            batches, self._sources = self._workers.take(step), self._row_sources(step)
        else:
            if self._pending is None or self._pending[0] != step:
                self._pending = (step, self._executor.submit(self._produce, step))
            batches, self._position, self._sources = self._pending[1].result()
            self._pending = (step + 1, self._executor.submit(self._produce, step + 1))
        self._step = step + 1
        return batches

    def step_sources(self) -> list[torch.Tensor] | None:
        """Per microbatch of the last step `next_step` returned, each row's source index in
        `source_names()` (int64 [local_batch_size]); None without a mixture."""
        return self._sources

    def source_names(self) -> list[str]:
        """A mixture's source names, in the order of `step_sources`' indices ([] without one)."""
        return [p.name for p in self.order.parts] if isinstance(self.order, MixtureOrder) else []

    def describe_step(self, step: int, shown: int = 16) -> str:
        """The data global step `step` (0-based) trained on, as a report can name it: the token
        cache's samples (the first `shown`), or this rank's rows of a stream."""
        if self.sharded:
            start, stop = self._items.rows(step, 0)[0], self._items.rows(step + 1, 0)[0]
            return f"rows [{start}, {stop}) of dp rank {self.dp_rank}'s share of the stream"
        g = self.global_batch_size
        samples = self.step_samples(step)
        more = f", ... ({len(samples)} in all)" if len(samples) > shown else ""
        return (
            f"data order positions [{step * g}, {(step + 1) * g}) (epoch "
            f"{step * g // self.num_samples}): token cache samples "
            + ", ".join(map(str, samples[:shown]))
            + more
        )

    def step_samples(self, step: int) -> list[int]:
        """The token cache's samples of global step `step` (0-based): the whole global batch,
        every dp rank's rows in order."""
        assert not self.sharded, "a stream's rows are per dp rank, with no global sample ids"
        g = self.global_batch_size
        return self.order.samples(step * g, (step + 1) * g).tolist()

    def source_tokens(self) -> dict[str, int]:
        """A mixture's tokens_seen/<name>: each source's tokens in the steps consumed so far. A
        function of the step (the blend's), so every rank has it without a collective."""
        if not isinstance(self.order, MixtureOrder):
            return {}
        counts = self._walker().counts_at(self._step * self.global_batch_size)
        seq_len = self._order_state["seq_len"]  # packed: every sample holds seq_len targets
        return {f"tokens_seen/{p.name}": c * seq_len for p, c in zip(self.order.parts, counts)}

    def skipped_rows(self) -> int | None:
        """Bad rows left out (None when training.dataset_max_bad_rows is off): the corpus's,
        counted when it was tokenized, or this rank's share of a stream's so far, as of the last
        step consumed (through the chunk of documents that step's rows came from)."""
        if self._skipped_rows is None or not self.sharded:
            return self._skipped_rows
        return self._position["skipped_rows"]

    def state_dict(self) -> dict:
        sd = {"step": self._step, **self._order_state}
        if isinstance(self.order, MixtureOrder):  # so a resume need not walk the blend from 0
            sd["mixture_walk"] = self._walker().walk_state(self._step * self.global_batch_size)
        return sd

    def _walker(self) -> MixtureOrder:
        """A mixture's own walker for the steps consumed (state_dict, source_tokens)."""
        if self._tally is None:
            self._tally = self.order.walker()
        return self._tally

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
        keys += ("mixture",) * bool(mine.get("mixture") or sd.get("mixture"))
        bad = [
            f"{k}: checkpoint {sd.get(k)!r} vs now {mine.get(k)!r}"
            for k in keys
            if sd.get(k) != mine.get(k)
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
            self._seek(stream, int(sd["step"]))
        if walk := sd.get("mixture_walk"):  # the same blend (checked above): start there
            self.order.start_from(walk)
            self._walker().start_from(walk)
            self._rows_walk = None  # made anew from the order's restart point
        self._step = int(sd["step"])

    def _seek(self, stream: dict | None, step: int) -> None:
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
        self.order.seek(stream, row=self._items.rows(step, 0)[0])
        self._position = self.order.position()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._pending = None
        if self._workers is not None:
            self._workers.close()


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
        g = self.local_batch_size * self.dp_degree
        # This rank's slice of each global batch, as of a training step of one microbatch.
        start, stop = microbatch_rows(
            0, 0, self.dp_rank, dp_degree=self.dp_degree, num_microbatches=1,
            local_batch_size=self.local_batch_size,
        )  # fmt: skip
        samples = iter(self.samples())
        for i in count():
            rows = [] if 0 < steps <= i else list(islice(samples, g))
            if not rows:
                return
            rows += [np.empty(0, dtype=np.uint32)] * (g - len(rows))
            yield self.make_batch(rows[start:stop])


def _source(training: Training, validation: Validation, split: str) -> TextSource:
    if split == "validation" and validation.dataset_path:
        return local_source(validation.dataset_path, training.dataset_text_column)
    t = training
    return build_source(
        t.dataset, t.dataset_path, t.dataset_text_column, split, t.dataset_streaming,
        t.dataset_max_bad_rows,
    )  # fmt: skip


def _cached_split(source, tokenizer, training: Training, validation: Validation, split: str):
    """(get, lo, hi, skipped rows): cached samples [lo, hi) are `split`. Without
    validation.dataset_path the last holdout_fraction of the samples is validation, and training
    never sees it."""
    own_val = split == "validation" and validation.dataset_path
    path = validation.dataset_path if own_val else training.dataset_path
    if is_prepared(path):  # prepared beforehand: no tokenizing at run time
        cache = open_tokens(path, tokenizer)
    else:
        t = training
        cache = prepare_token_cache(source, tokenizer, t.data_cache_dir, t.data_build_timeout_s)
    skipped = check_skipped(cache.meta, training.dataset_max_bad_rows, f"token store {cache.path}")
    get, total = cached_samples(cache, training.seq_len, training.packing)
    if validation.dataset_path:  # validation has its own files: each split is its whole source
        return get, 0, total, skipped
    held_out = math.ceil(total * validation.holdout_fraction)
    lo, hi = (total - held_out, total) if split == "validation" else (0, total - held_out)
    return get, lo, hi, skipped


def _batch_maker(training: Training, tokenizer, vocab_size: int):
    return partial(collate, seq_len=training.seq_len, pad=tokenizer.eos_id, vocab_size=vocab_size)


def _check_rank(dp_rank: int, dp_degree: int) -> None:
    if not 0 <= dp_rank < dp_degree:
        raise ValueError(f"dp_rank {dp_rank} out of range for dp_degree {dp_degree}")


def _train_order(
    source, tokenizer, t: Training, val: Validation, *, dp_rank, dp_degree, global_batch_size, seed
) -> tuple[PermutedOrder | ShardStream, int, int]:
    """(order, num_samples, skipped rows): this dp rank's share of a stream (-1 samples: it has
    no end; its rows are counted as they are read), or the permuted training split of the
    cache."""
    if source.streaming:
        if t.dataloader.num_workers > 0:
            raise ConfigError(
                "training.dataloader.num_workers > 0 needs a token store: a streamed source is "
                "tokenized in order by one reader whose exact position each checkpoint saves, "
                "which worker processes cannot share; prepare the data with "
                "scripts/prepare_data.py and train from that directory, or set num_workers 0"
            )
        return shard_stream(source, tokenizer, t.seq_len, t.packing, dp_rank, dp_degree), -1, 0
    get, lo, hi, skipped = _cached_split(source, tokenizer, t, val, "train")
    if hi - lo < global_batch_size:
        raise ConfigError(
            f"the training split has {hi - lo} samples, fewer than one global batch "
            f"({global_batch_size}); use more data, a smaller seq_len or a smaller "
            "global_batch_size"
        )
    return PermutedOrder(get, lo, hi, seed), hi - lo, skipped


def _mixture_order(t: Training, val: Validation, tokenizer, seed: int, global_batch_size: int):
    """(MixtureOrder, samples of all sources, fingerprint) of training.mixture; each source's
    first log line names it, its weight and its files."""
    (_, weights), *later = stage_weights(t)
    logger.info("training data: %d sources, blended by weight", len(t.mixture))
    parts, base, prints = [], 0, []
    for m, weight in zip(t.mixture, weights, strict=True):
        mt = replace(
            t, dataset="local", dataset_path=m.dataset_path, dataset_text_column=m.text_column
        )
        source = _source(mt, val, "train")
        logger.info("training data: %s, weight %.4g: %s", m.name, weight, source.describe())
        # Its own validation files: nothing of its training files is held out.
        own_val = replace(val, dataset_path=m.validation_path) if m.validation_path else val
        get, lo, hi, _ = _cached_split(source, tokenizer, mt, own_val, "train")
        if hi <= lo:
            raise ConfigError(f"mixture source {m.name!r} has no training samples: use more data")
        # Each source its own permutation seed: two sources of one size do not move in step.
        own_seed = seed + zlib.crc32(m.name.encode())
        parts.append(Part(m.name, weight, PermutedOrder(get, lo, hi, own_seed), base))
        base += hi
        prints.append([m.name, weight, source.fingerprint])
    for step, stage in later:
        logger.info("training data: from step %d, weights %s", step, _weights_text(t, stage))
    stages = [((step - 1) * global_batch_size, stage) for step, stage in later]  # logged steps: 1..
    fingerprint = hashlib.sha256(json.dumps(prints).encode()).hexdigest()[:16]
    samples = sum(p.order.n for p in parts)
    return MixtureOrder(parts, t.mixture_exhausted, stages), samples, fingerprint


def _weights_text(t: Training, weights: list[float]) -> str:
    return ",".join(f"{m.name}={w:.6g}" for m, w in zip(t.mixture, weights, strict=True))


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
    `titanlite.job.resolve_global_batch(training, dp_degree)`; `vocab_size` is the model's;
    `seed` orders the samples.
    `validation` decides what is held out (None: its defaults, the same holdout as a run with
    validation on, so switching validation on does not change the training data)."""
    t, val = training, validation or Validation()
    _check_rank(dp_rank, dp_degree)
    per_rank = num_microbatches * t.local_batch_size  # as resolve_global_batch split it
    assert global_batch_size == per_rank * dp_degree, (global_batch_size, per_rank, dp_degree)
    if t.mixture:
        order, num_samples, fingerprint = _mixture_order(t, val, tokenizer, seed, global_batch_size)
        streaming, skipped = False, 0
    else:
        source = _source(t, val, "train")
        logger.info("training data: 1 source, %s, weight 1", source.describe())
        order, num_samples, skipped = _train_order(
            source, tokenizer, t, val, dp_rank=dp_rank, dp_degree=dp_degree,
            global_batch_size=global_batch_size, seed=seed,
        )  # fmt: skip
        streaming, fingerprint = source.streaming, source.fingerprint
    order_state = dict(
        seed=seed,
        seq_len=t.seq_len,
        global_batch_size=global_batch_size,
        packing=t.packing,
        num_samples=num_samples,
        shuffle="stream order" if streaming else shuffle.NAME,
        fingerprint=fingerprint,
    )
    if t.mixture:  # a changed mixture would continue another blend: refused on resume
        order_state["mixture"] = "; ".join(
            f"from step {step}: {_weights_text(t, ws)}" for step, ws in stage_weights(t)
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
        skipped_rows=skipped if t.dataset_max_bad_rows else None,
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
        samples = partial(validation_samples, source.stream, tokenizer, t.seq_len, t.packing)
        num_samples = -1
    else:
        get, lo, hi, _ = _cached_split(source, tokenizer, t, val, "validation")
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


def build_source_validation_loaders(
    training: Training, validation: Validation, tokenizer, **ranks
) -> dict[str, ValidationLoader]:
    """{name: validation loader} of each mixture source with a validation_path (val_loss/<name>),
    read as validation.dataset_path is, with the source's text column. `ranks`: dp_rank,
    dp_degree, vocab_size as build_validation_loader's."""
    return {
        m.name: build_validation_loader(
            replace(training, dataset_text_column=m.text_column),
            replace(validation, dataset_path=m.validation_path),
            tokenizer,
            **ranks,
        )
        for m in training.mixture
        if m.validation_path
    }
