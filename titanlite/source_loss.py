"""A mixture's training loss per source (loss/<name>), from the step's own per-token losses.

Each row of a step comes from one source (a mixture packs each source's documents apart; the
blend assigns whole rows, titanlite/data/mixture.py), so the loader gives each row's source
index. On the device the loss sums by source with the rows' one-hot sources ([b] row sums times
[b, n]), accumulated over microbatches like the loss itself; the target tokens per source are
counted on the host from the labels and ride in the step's one all-reduce (`count_step_tokens`).
Nothing is read on the host until a log step.
"""

import torch
import torch.nn.functional as F

from titanlite.distributed import to_device
from titanlite.loss import IGNORE_INDEX


class StepSources:
    """A step's row sources: the one-hot rows per microbatch on the device, and this rank's
    target tokens per source (host, int64 [n])."""

    def __init__(self, sources: list[torch.Tensor], microbatches, n: int, device):
        self.n = n
        self.rows = [to_device(F.one_hot(s, n).float(), device) for s in sources]
        self.tokens = torch.zeros(n, dtype=torch.int64)
        for s, (_, labels) in zip(sources, microbatches, strict=True):
            self.tokens.index_add_(0, s, (labels != IGNORE_INDEX).sum(1))


def source_losses(names: list[str], sums: torch.Tensor, tokens: torch.Tensor) -> dict:
    """{loss/<name>: its mean loss over its tokens of the step}, one host read (log steps only);
    a source with no tokens in the step (a stage that switched it off) is left out."""
    sums, tokens = torch.stack([sums.double(), tokens.to(sums.device).double()]).tolist()
    return {f"loss/{n}": s / t for n, s, t in zip(names, sums, tokens, strict=True) if t > 0}
