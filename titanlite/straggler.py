"""Which rank is slow, and why: data loading or compute.

Ranks meet at every collective (FSDP's all-gathers and reduce-scatters, TP's, the step's token
count and gradient norm), so every rank's step takes as long as the slowest rank's: step time
says nothing about who is slow. What differs is the work each rank does alone between
collectives. Two pieces of it are timed: loading the step's data, and the optimizer step on the
rank's own shards, per parameter element (pipeline stages of unequal size then compare). A
rank's lag is its time on these over a median rank's. The compute part counts only what the
optimizer shows: a device slower at everything is named, but the lag reported for it is its
optimizer's share (forward and backward cannot be timed per rank: their waits for the slow rank
are inside the collectives).

On log steps only, each rank's two figures travel in one all-gather of two floats per rank; the
log rank reports the rank with the largest lag, and warns, with the host name, about a rank that
lags by more than a threshold on several log steps in a row (the host names are gathered then,
not on every log step).
"""

import logging
import socket

import torch
import torch.distributed as dist

from titanlite.distributed import local_value

logger = logging.getLogger("titanlite")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU, where nothing is queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def local_numel(model: torch.nn.Module) -> int:
    """Parameter elements this rank holds (its shards under FSDP/TP, its stages under PP)."""
    return sum(local_value(p).numel() for p in model.parameters())


class SlowRankFinder:
    """Gathers per-rank data and optimizer times on log steps; reports the slowest rank."""

    def __init__(self, world_size: int, device: torch.device, threshold_pct: float,
                 patience: int, numel: int, warns: bool = True):  # fmt: skip
        self.world_size, self.device, self.numel, self.warns = world_size, device, numel, warns
        self.threshold_pct, self.patience = threshold_pct, patience
        self.streak_rank, self.streak = None, 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def gather(self, data_s: float, optimizer_s: float | None) -> torch.Tensor:
        """[world, 2]: every rank's data seconds per step and optimizer seconds per parameter
        element (NaN where the optimizer was not timed: it steps in backward there)."""
        per_elem = float("nan") if optimizer_s is None else optimizer_s / max(self.numel, 1)
        mine = torch.tensor([data_s, per_elem], dtype=torch.float64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine)  # (all_gather_into_tensor is deprecated on torch 2.13)
        return torch.stack(out).cpu()

    def report(self, step_s: float, data_s: float, optimizer_s: float | None) -> dict:
        """Metrics for the log step (empty in world 1): the slowest rank, its lag over the
        median as a percentage of the step, split into data and compute."""
        if not self.enabled:
            return {}
        figures = self.gather(data_s, optimizer_s)
        data, per_elem = figures[:, 0], figures[:, 1]
        data_lag = (data - data.median()).clamp(min=0)
        compute_lag = torch.zeros_like(data_lag)
        if not per_elem.isnan().any():  # this rank's optimizer time less a median rank's
            compute_lag = ((per_elem - per_elem.median()) * self.numel).clamp(min=0)
        lag = data_lag + compute_lag
        rank = int(lag.argmax())
        pct = 100 * lag[rank].item() / step_s if step_s > 0 else 0.0
        self._track(rank, pct, "data" if data_lag[rank] >= compute_lag[rank] else "compute")
        return {
            "slow_rank": rank,
            "slow_rank_lag_pct": pct,
            "slow_rank_data_lag_pct": 100 * data_lag[rank].item() / step_s if step_s else 0.0,
        }

    def _track(self, rank: int, pct: float, cause: str) -> None:
        over = self.threshold_pct > 0 and pct > self.threshold_pct
        self.streak = self.streak + 1 if over and rank == self.streak_rank else int(over)
        self.streak_rank = rank if over else None
        if self.streak == self.patience:
            # Every rank decides alike (the same gathered figures): all of them gather the names.
            hosts = self.host_names()
            if not self.warns:
                return
            logger.warning(
                "rank %d on host %s has been the slowest on %d log steps in a row, %.0f%% of a "
                "step behind the median rank (mostly %s): check that host's %s",
                rank, hosts[rank], self.patience, pct, cause,
                "storage and data workers" if cause == "data" else "device (clocks, temperature) "
                "and other processes",
            )  # fmt: skip

    def host_names(self) -> list[str]:
        """Every rank's host name, gathered from all ranks (only when there is a warning)."""
        hosts = [None] * self.world_size
        dist.all_gather_object(hosts, socket.gethostname())
        return hosts
