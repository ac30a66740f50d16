"""Stop on request: SIGTERM (a scheduler's kill) or SIGUSR1 (SLURM's warning before preemption).

A signal only sets a flag. The flag must become a decision every rank takes at the same step (a
signal may reach some ranks a step later than others), so the trainer adds it to the step's
token-count all-reduce: a step's vote costs no collective and no host sync of its own. Every rank
then finishes the step, saves and exits together.
"""

import logging
import signal

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    def __init__(self):
        self.requested = False  # this rank's vote; the trainer makes the decision collective

    def install(self) -> None:
        for sig in SIGNALS:
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        logger.warning("Got signal %d: will save a checkpoint and stop", signum)
        self.requested = True
