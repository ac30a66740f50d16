"""The processes a store build tokenizes in: a pool of spawned workers, each holding the
tokenizer, or this process alone (workers = 0) behind the same `submit` interface."""

import multiprocessing
import multiprocessing.connection
import os
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager

import numpy as np

_tokenizer = None  # this process's tokenizer: set by _init_worker, or by `tokenizer_pool(0)`
_in_process = False  # True in the main process of a build without workers


def _init_worker(tokenizer) -> None:
    global _tokenizer
    _tokenizer = tokenizer
    # A killed main process leaves its workers blocked on the task queue: exit with it instead.
    parent = multiprocessing.parent_process()
    threading.Thread(target=_exit_with_parent, args=(parent.sentinel,), daemon=True).start()


def _exit_with_parent(sentinel) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(1)


def encode(texts: list[str]) -> list[np.ndarray]:
    """bos + tokens + eos of each text with this process's tokenizer: in a worker one text at a
    time on its one thread (the pool is the parallelism), in process on the tokenizer's threads."""
    if _in_process:
        return _tokenizer.encode_batch(texts, bos=True, eos=True)
    return [_tokenizer.encode_array(t, bos=True, eos=True) for t in texts]


class _InProcess:
    """`submit` runs the task at once, here; its future is done when it returns."""

    def submit(self, fn, *args, **kwargs) -> Future:
        future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as e:
            future.set_exception(e)
        return future


@contextmanager
def tokenizer_pool(workers: int, tokenizer):
    """An executor whose tasks tokenize with `encode`: `workers` spawned processes (spawn: no
    fork of a process that may hold threads), or this process for workers = 0."""
    global _tokenizer, _in_process
    if workers == 0:
        saved = _tokenizer, _in_process
        _tokenizer, _in_process = tokenizer, True
        try:
            yield _InProcess()
        finally:
            _tokenizer, _in_process = saved
        return
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, spawn, _init_worker, (tokenizer,)) as pool:
        try:
            yield pool
        except BaseException:  # an error or a kill: drop the queued tasks, not run them out
            pool.shutdown(wait=False, cancel_futures=True)
            raise
