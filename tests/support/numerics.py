"""Comparing tensors the way the accumulation tests state their bounds."""

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference relative to the reference tensor's largest magnitude."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
