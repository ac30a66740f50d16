"""Worker: train.py on every rank, with rank 1 made slow on purpose.

argv[1] is what to slow: "data" (each step's batch takes 0.6 s longer to load) or "compute"
(each optimizer step takes 0.6 s longer, as on a throttled device); the rest is train.py's
arguments.
"""

import functools
import os
import sys
import time

import torch

import train
from titanlite.data.loader import TrainLoader


def slowed(method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        time.sleep(0.6)
        return method(*args, **kwargs)

    return wrapper


if __name__ == "__main__":
    what, argv = sys.argv[1], sys.argv[2:]
    if os.environ["RANK"] == "1":
        if what == "data":
            TrainLoader.next_step = slowed(TrainLoader.next_step)
        else:
            torch.optim.AdamW.step = slowed(torch.optim.AdamW.step)
    sys.exit(train.main(argv))
