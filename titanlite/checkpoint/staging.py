"""The host copy an async save writes from, kept across saves and made off the training thread.

torch's DefaultStager cannot be reused on every supported torch: 2.11 closes its StateDictStager
after each stage, which drops the cached buffers and clears its copy table, so the second save
fails (`KeyError: <class 'type'>`). This stager drives StateDictStager itself and closes it only
when the run ends.
"""

from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from titanlite.torch_compat import state_dict_stager


class ReusingStager(AsyncStager):
    """Staging buffers kept across async saves: the first save allocates this rank's host copy
    of the state (pinned when it comes from a GPU, for fast device-to-host copies), later saves
    copy into it.

    The copy runs in a thread of its own, so `stage()` returns at once with a Future of the
    copy: the training thread goes on with the next step's forward and backward, which only read
    the weights, while the state is copied. Whoever changes the state in place (the optimizer
    step) must first wait for that Future (CheckpointManager.wait_for_staging). On a GPU the
    copies run on a stream of their own that first waits for the work queued before `stage()`
    (the last optimizer step), so they overlap the next step's kernels too.
    """

    _synchronize_after_execute = False  # the Future completes with a finished copy

    def __init__(self):
        self._cuda = torch.cuda.is_available()
        self._stager = state_dict_stager(pin_memory=self._cuda)
        self._stream = torch.cuda.Stream() if self._cuda else None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="titanlite-staging")

    def stage(self, state_dict) -> Future:
        queued = torch.cuda.current_stream().record_event() if self._cuda else None
        return self._thread.submit(self._copy, state_dict, queued)

    def _copy(self, state_dict, queued):
        if not self._cuda:
            return self._stager.stage(state_dict)
        torch.cuda.set_device(self._stream.device)  # a new thread starts on device 0
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(queued)
            staged = self._stager.stage(state_dict, non_blocking=True)
        self._stream.synchronize()  # the non-blocking device-to-host copies have landed
        return staged

    def close(self) -> None:
        self._thread.shutdown()
        self._stager.close()  # frees the buffers (unpins them on CUDA)
