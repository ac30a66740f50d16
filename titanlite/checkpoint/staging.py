"""The host copy an async save writes from, kept across saves.

torch's DefaultStager cannot be reused on every supported torch: 2.11 closes its StateDictStager
after each stage, which drops the cached buffers and clears its copy table, so the second save
fails (`KeyError: <class 'type'>`). This stager drives StateDictStager itself and closes it only
when the run ends.
"""

import torch
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.staging import AsyncStager


class ReusingStager(AsyncStager):
    """Staging buffers kept across async saves: the first save allocates this rank's host copy
    of the state (pinned when it comes from a GPU, for fast device-to-host copies), later saves
    copy into it. Staging blocks the caller: the training step after `save()` updates the
    weights in place."""

    _synchronize_after_execute = False  # stage() returns a finished copy

    def __init__(self):
        self._cuda = torch.cuda.is_available()
        self._stager = StateDictStager(pin_memory=self._cuda, share_memory=False)

    def stage(self, state_dict):
        staged = self._stager.stage(state_dict, non_blocking=self._cuda)
        if self._cuda:
            torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
        return staged

    def close(self) -> None:
        self._stager.close()  # frees the buffers (unpins them on CUDA)
