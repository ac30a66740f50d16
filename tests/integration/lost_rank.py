"""Worker: train.py on every rank, with rank 1 lost as it starts one step: stopped (SIGSTOP, a
hung process) or killed (SIGKILL, a dead node).

argv[1] is "stop" or "kill", argv[2] the step (1-based, as the logs number steps); the rest is
train.py's arguments.
"""

import functools
import os
import signal
import sys

import train
from titanlite.data.loader import TrainLoader

if __name__ == "__main__":
    how, step, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    sig = signal.SIGSTOP if how == "stop" else signal.SIGKILL
    next_step = TrainLoader.next_step

    @functools.wraps(next_step)
    def lost_at_step(self):
        if self._step == step - 1 and os.environ["RANK"] == "1":
            os.kill(os.getpid(), sig)
        return next_step(self)

    TrainLoader.next_step = lost_at_step
    sys.exit(train.main(argv))
