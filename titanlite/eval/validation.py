"""The validation pass of a run: the token-weighted loss over the held-out split, every batch
counted once, never a mean of batch means."""

import math

import torch

from titanlite.distributed import dist_sum, local_value, to_device
from titanlite.loss import IGNORE_INDEX


class Validator:
    """Runs when its `schedule` is due (the trainer's: validation.freq and the last step, when a
    validation loader exists)."""

    def __init__(self, loader, validation, schedule, model_context, parallel_dims, device):
        self.schedule = schedule
        self.loader, self.steps = loader, validation.steps
        self.model_context, self.device = model_context, device
        # Tokens are counted on whole sequences (dp ranks); loss sums come from CP's parts too.
        self.dp_mesh, self.loss_mesh = parallel_dims.dp_mesh, parallel_dims.loss_mesh

    def due(self, step: int) -> bool:
        return self.schedule.due(step)

    @torch.no_grad()
    def run(self, model, chunk_tokens: int = 0) -> dict:
        model.eval()
        loss_sum = torch.zeros((), device=self.device)
        tokens = torch.zeros((), dtype=torch.int64, device=self.device)
        for tok, labels in self.loader.iter_batches(self.steps):
            tok, labels = to_device(tok, self.device), to_device(labels, self.device)
            with self.model_context():
                loss_sum += local_value(model(tok, labels, chunk_tokens=chunk_tokens))
            tokens += (labels != IGNORE_INDEX).sum()
        model.train()
        if hasattr(model, "reshard"):  # FSDP's root stays unsharded after a no-grad forward
            model.reshard()
        val_loss = (dist_sum(loss_sum, self.loss_mesh) / dist_sum(tokens, self.dp_mesh)).item()
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}
