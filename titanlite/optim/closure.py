"""The optimizer-step closure, as torch's optimizers evaluate it."""

import torch


def closure_loss(closure):
    """The loss `closure` recomputes (with gradients on, inside a no_grad step), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
