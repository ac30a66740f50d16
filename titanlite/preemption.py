"""Stop on request: SIGTERM (a preemption, a kill) or SIGUSR1 (SLURM's time-limit warning).

A signal only sets a flag. The flag must become a decision every rank takes at the same step (a
signal may reach some ranks a step later than others), so the trainer adds it to the step's
token-count all-reduce: a step's vote costs no collective and no host sync of its own. Every rank
then finishes the step, saves and exits together.
"""

import logging
import os
import signal

import torch
from torch.torch_version import TorchVersion

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


def stop_grace_seconds(configured: float, environ=os.environ, version: str = torch.__version__):
    """How long a stop signal leaves the ranks to finish their step and save before SIGKILL:
    checkpoint.stop_grace_seconds when set (a scheduler's grace, which torchrun cannot know),
    else torchrun's: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, which torchrun reads from torch 2.13 on
    (scripts/multinode_trainer.slurm sets it), and a fixed 30 s before."""
    if configured > 0:
        return configured
    if TorchVersion(version) >= (2, 13) and environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        return float(environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
    return 30.0


def warn_if_slower_than_grace(save_seconds: float, grace_seconds: float, what: str) -> bool:
    """One warning when a save took longer than a stop signal leaves: on preemption that save
    would be killed midway and the steps since the previous checkpoint lost."""
    if save_seconds <= grace_seconds:
        return False
    logger.warning(
        "%s took %.1f s, more than the %.0f s a stop signal (preemption, a requeue) leaves before "
        "SIGKILL: a stop would lose the steps since the previous checkpoint. Give the job a "
        "longer grace (SLURM GraceTime, SHUTDOWN_TIMEOUT in scripts/multinode_trainer.slurm) "
        "and set checkpoint.stop_grace_seconds to it, or save faster (faster storage)",
        what, save_seconds, grace_seconds,
    )  # fmt: skip
    return True
