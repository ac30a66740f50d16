"""The validation pass of a run: the token-weighted loss over the held-out split, every batch
counted once, never a mean of batch means; and of a mixture, over each source's own held-out
files (val_loss/<name>)."""

import math

import torch

from titanlite.distributed import dist_sum, local_value, to_device
from titanlite.loss import IGNORE_INDEX


class Validator:
    """Runs when its `schedule` is due (the trainer's: validation.freq and the last step, when a
    validation loader exists). `loader` gives val_loss (None: none), `per_source` {name: loader}
    val_loss/<name>."""

    def __init__(self, loader, validation, schedule, model_context, parallel_dims, device,
                 per_source=None):  # fmt: skip
        self.schedule = schedule
        self.loader, self.steps = loader, validation.steps
        self.per_source = per_source or {}
        self.model_context, self.device = model_context, device
        # Tokens are counted on whole sequences (dp ranks); loss sums come from CP's parts too.
        self.dp_mesh, self.loss_mesh = parallel_dims.dp_mesh, parallel_dims.loss_mesh

    def due(self, step: int) -> bool:
        return self.schedule.due(step)

    @torch.no_grad()
    def run(self, model, chunk_tokens: int = 0) -> dict:
        model.eval()
        values = {}
        if self.loader is not None:
            val_loss = self._loss(model, self.loader, chunk_tokens)
            values.update(val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50.0)))
        for name, loader in self.per_source.items():
            values[f"val_loss/{name}"] = self._loss(model, loader, chunk_tokens)
        model.train()
        return values

    def _loss(self, model, loader, chunk_tokens: int) -> float:
        loss_sum = torch.zeros((), device=self.device)
        tokens = torch.zeros((), dtype=torch.int64, device=self.device)
        for tok, labels in loader.iter_batches(self.steps):
            tok, labels = to_device(tok, self.device), to_device(labels, self.device)
            with self.model_context():
                loss_sum += local_value(model(tok, labels, chunk_tokens=chunk_tokens))
            tokens += (labels != IGNORE_INDEX).sum()
        if hasattr(model, "reshard"):  # FSDP's root stays unsharded after a no-grad forward
            model.reshard()
        return (dist_sum(loss_sum, self.loss_mesh) / dist_sum(tokens, self.dp_mesh)).item()
