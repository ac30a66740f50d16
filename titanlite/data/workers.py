"""Training microbatches made by torch DataLoader worker processes (training.dataloader).

The main process keeps every decision about the data. Item (step, i) of the map-style dataset
(`titanlite.data.order.Microbatches`) is microbatch i of this dp rank's rows of global step
`step`, the same item `TrainLoader`'s own thread makes with num_workers 0. A worker only reads
those windows from the memory-mapped token store and collates them, so the batches are bitwise
the same for any number of workers, and the workers hold no state worth saving: the loader's
state stays the global step, and a resume restarts the sampler at the checkpoint's step.

Workers start with fork on Linux. The parent has threads by then (gloo's, the tokenizer pool,
TensorBoard's writer, torch's intra-op pool), and a forked child gets none of them, only their
memory: a lock one of them held stays held in the child. What a worker runs takes no such lock:
numpy slicing of read-only memory maps, the shuffle's integer arithmetic, collation into new
CPU tensors, and torch's worker loop (which sets one intra-op thread and never touches CUDA or
a process group; pinning happens in the parent's pin thread). Python re-creates its own locks
(GIL, imports, logging) after a fork. Fork starts a worker in milliseconds and shares the
parent's memory maps, where spawn or forkserver (Python 3.14's Linux default) would import
torch again in every worker (seconds each) and pickle the dataset; elsewhere the platform's
default (spawn) is used, for which the dataset pickles.
"""

import atexit
import logging
import signal
import sys
from itertools import count

import torch

from titanlite.config import DataLoader
from titanlite.data.order import Microbatches
from titanlite.preemption import SIGNALS
from titanlite.torch_compat import shutdown_loader_workers

logger = logging.getLogger(__name__)
_START_METHOD = "fork" if sys.platform == "linux" else None


def _ignore_stop_signals(worker_id: int) -> None:
    """A scheduler signals every process of the job (SIGTERM, SLURM's SIGUSR1): the trainer
    then finishes its step, saves and closes the loader, so the workers must outlive the signal
    (torch fails the trainer the moment a worker dies). Forked workers would otherwise run the
    trainer's own handlers, spawned ones would die."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class _StepsFrom(torch.utils.data.Sampler):
    """(step, i) for every microbatch i of every step from `first` on, without end; iterated in
    the main process, so setting `first` before a new `iter()` moves where the loader starts."""

    def __init__(self, num_microbatches: int):
        self.first, self.num_microbatches = 0, num_microbatches

    def __iter__(self):
        for step in count(self.first):
            for i in range(self.num_microbatches):
                yield step, i


class WorkerSteps:
    """One dp rank's steps from `cfg.num_workers` processes; `take(step)` returns its
    microbatches. A step other than the one after the last taken (the first, or a resume)
    restarts the loader there; the items already prefetched are dropped.

    The workers ignore stop signals, so they must be stopped by `close()`; it also runs at
    interpreter exit, before multiprocessing's own exit hook, whose SIGTERM they would ignore
    while it waits for them (a run that dies of an error would hang instead of exiting)."""

    def __init__(self, items: Microbatches, cfg: DataLoader, pin: bool):
        self._sampler = _StepsFrom(items.num_microbatches)
        self._loader = torch.utils.data.DataLoader(
            items,
            batch_size=None,  # an item is already a microbatch
            sampler=self._sampler,
            num_workers=cfg.num_workers,
            pin_memory=pin,
            persistent_workers=cfg.persistent_workers,
            prefetch_factor=cfg.prefetch_factor or None,  # None: torch's default, 2
            multiprocessing_context=_START_METHOD,
            worker_init_fn=_ignore_stop_signals,
        )
        self._batches, self._next = None, None
        atexit.register(self.close)  # exit hooks run last-registered first

    def take(self, step: int) -> list:
        if step != self._next:
            if not self._loader.persistent_workers:  # iter() starts new ones
                self._stop_workers()
            self._sampler.first = step
            self._batches = iter(self._loader)
            logger.info("training batches from %d worker processes", self._loader.num_workers)
        self._next = step + 1
        return [next(self._batches) for _ in range(self._sampler.num_microbatches)]

    def _stop_workers(self) -> None:
        # torch's own teardown, which its iterator's __del__ calls: explicit here, because an
        # error raised from a worker keeps the iterator alive in the traceback.
        if self._batches is not None:
            shutdown_loader_workers(self._batches)
        self._batches = None

    def close(self) -> None:
        atexit.unregister(self.close)
        self._stop_workers()
