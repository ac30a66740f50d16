"""Worker: train.py on every rank, with the batch of one step replaced by random token ids on
every rank, as a corrupt shard of the corpus would give.

argv[1] is that step (1-based, as the logs number steps); the rest is train.py's arguments.
"""

import functools
import sys

import torch

import train
from titanlite.data.loader import TrainLoader


def corrupt_at(step: int, next_step):
    @functools.wraps(next_step)
    def wrapper(self):
        batches = next_step(self)
        if self._step != step:  # the loader's count of steps handed out, after this one
            return batches
        g = torch.Generator().manual_seed(step)
        junk = [torch.randint(0, 512, tokens.shape, generator=g) for tokens, _ in batches]
        return [(j, j.roll(-1, dims=1)) for j in junk]

    return wrapper


if __name__ == "__main__":
    step, argv = int(sys.argv[1]), sys.argv[2:]
    TrainLoader.next_step = corrupt_at(step, TrainLoader.next_step)
    sys.exit(train.main(argv))
