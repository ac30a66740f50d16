"""train.py with a fault injected as one step starts, for the fault drill and the tests:

    torchrun --nproc_per_node 2 scripts/fault_inject.py kill 3 [train.py options]

- `kill`: rank 1 is SIGKILLed (a dead node); `stop`: rank 1 is SIGSTOPped (a hung process);
- `junk`: every rank's batch of that step is random token ids (a corrupt shard of the corpus).

The step is 1-based, as the logs number steps. A restarted attempt (torchrun --max-restarts)
runs clean. The moment of the fault goes to `{dump_folder}/fault_at` (seconds since the epoch).
"""

import functools
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train  # noqa: E402
from titanlite.config_parse import parse_args  # noqa: E402
from titanlite.data.loader import TrainLoader  # noqa: E402


def inject(how: str, step: int, dump: Path):
    next_step = TrainLoader.next_step

    @functools.wraps(next_step)
    def faulty(self):
        if self._step != step - 1:  # the loader's count of steps handed out before this one
            return next_step(self)
        if how == "junk" or os.environ.get("RANK") == "1":
            (dump / "fault_at").write_text(f"{time.time()}\n")
        if how == "junk":
            g = torch.Generator().manual_seed(step)
            batches = next_step(self)
            junk = [torch.randint(0, 512, tokens.shape, generator=g) for tokens, _ in batches]
            return [(j, j.roll(-1, dims=1)) for j in junk]
        if os.environ.get("RANK") == "1":
            os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
        return next_step(self)

    TrainLoader.next_step = faulty


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    how, step, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        inject(how, step, Path(parse_args(argv).job.dump_folder))
    sys.exit(train.main(argv))
