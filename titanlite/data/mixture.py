"""A weighted mixture of named sources ([[training.mixture]]), blended deterministically.

Each source has its own training order (its samples under its own permutation each epoch,
`PermutedOrder`). Position p of the blended order goes to the source furthest behind its share:
k = argmax_k (w_k * (p + 1) - c_k), ties to the first, where c_k counts k's positions before p
(Megatron-LM's blended-dataset rule). So after any n positions every source holds its share of
them within one sequence, and, with packing, of the tokens (every sample holds seq_len targets;
a mixture requires packing). The blend is a function of the position alone: every dp rank, at any
dp degree and layout, computes the same sources for the global rows, and a resume at any step
continues it. A source that runs out starts a new epoch of its own order (logged) or, with
training.mixture_exhausted = "stop", stops the run at that point.

Computing the blend at position p walks it from 0 (a few million positions per second); the
walk is kept, so reading the steps in order costs one pass in all.
"""

import logging
import threading
from dataclasses import dataclass

import numpy as np

from titanlite.config import ConfigError, Training, Validation

logger = logging.getLogger(__name__)


def check_mixture(t: Training, val: Validation) -> None:
    """The mixture's own mistakes, each one line, before any work."""
    if not t.mixture:
        return
    names = [m.name for m in t.mixture]
    where = "training.mixture"
    if not all(names):
        raise ConfigError(f"every [[{where}]] needs a name (used in the log and the metrics)")
    # loss/<name> and val_loss/<name> beside TensorBoard's loss/global and loss/validation
    if bad := [n for n in names if "/" in n or n in ("global", "validation")]:
        raise ConfigError(
            f"{where} name {bad[0]!r} would collide in the metrics (loss/<name>): use no '/' and "
            "neither 'global' nor 'validation'"
        )
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(f"{where} names {twice} more than once: give each source its own name")
    for m in t.mixture:
        if not m.dataset_path:
            raise ConfigError(f"{where} {m.name!r} needs a dataset_path (files, globs or tokens)")
        if not m.weight > 0:  # NaN too
            raise ConfigError(
                f"{where} {m.name!r} has weight {m.weight}: weights must be > 0 (drop the source "
                "to leave it out)"
            )
    if t.dataset_path or t.dataset not in ("python_stdlib", "local"):
        raise ConfigError(
            f"{where} replaces training.dataset and training.dataset_path: unset them"
        )
    if t.dataset_streaming or not t.packing:
        raise ConfigError(
            f"{where} needs training.packing and no dataset_streaming: its weights count tokens, "
            "which packed samples of a token store hold seq_len each of"
        )
    stage_weights(t)  # its own errors
    if val.enable and not val.dataset_path and not any(m.validation_path for m in t.mixture):
        raise ConfigError(
            f"validation of a {where} needs validation.dataset_path (val_loss) or a source's "
            "validation_path (val_loss/<name>): held-out data is not drawn from a blend"
        )


def _stage_weights(text: list[str], names: list[str], where: str) -> list[float]:
    """["web=0.3", ...] -> a weight per source in `names` order (0 for one left out)."""
    given = {}
    for item in text:
        name, eq, value = item.partition("=")
        try:
            given[name.strip()] = float(value) if eq else None
        except ValueError:
            given[name.strip()] = None
        if given[name.strip()] is None:
            raise ConfigError(f"{where}: {item!r} is not name=weight")
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ConfigError(f"{where} names {unknown}, which no [[training.mixture]] has")
    weights = [given.get(n, 0.0) for n in names]
    if not all(w >= 0 for w in weights) or not sum(weights) > 0:
        raise ConfigError(f"{where}: weights must be >= 0 and not all 0, got {weights}")
    return weights


def stage_weights(t: Training) -> list[tuple[int, list[float]]]:
    """[(first step, normalized weight per source)]: the mixture's own, then each stage's."""
    names = [m.name for m in t.mixture]
    stages = [(1, [m.weight for m in t.mixture])]  # steps as the log numbers them, from 1
    for i, stage in enumerate(t.mixture_stage):
        where = f"training.mixture_stage[{i}]"
        if not t.mixture:
            raise ConfigError(f"{where} needs the [[training.mixture]] sources it reweighs")
        if stage.from_step <= stages[-1][0]:
            raise ConfigError(
                f"{where}.from_step {stage.from_step} must be after the previous stage's "
                f"{stages[-1][0]} (stages in step order; the first mix starts at step 1)"
            )
        stages.append((stage.from_step, _stage_weights(stage.weights, names, where)))
    return [(step, [w / sum(ws) for w in ws]) for step, ws in stages]


@dataclass
class Part:
    """One source of the blend: its name, normalized weight, and its own order."""

    name: str
    weight: float
    order: object  # PermutedOrder over this source's training samples
    base: int  # where its samples start in the blend's sample numbering (step_samples)


class MixtureOrder:
    """Global positions -> the blended sources' samples; the interface of `PermutedOrder`.

    `stages`: [(first position, weight per source)] after the first mix (the parts' weights);
    within a stage the rule counts from the stage's first position, so every stage holds its
    own shares from its first step on, and each source continues its own order across them."""

    def __init__(self, parts: list[Part], exhausted: str = "repeat", stages=()):
        self.parts, self.exhausted = parts, exhausted
        self.stages = [(0, [p.weight for p in parts]), *stages]
        self._base: dict | None = None  # a saved walk to restart from (`start_from`)
        self._restart(0)
        self._lock = threading.Lock()  # the loader's thread and the trainer's may both walk

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def walker(self) -> "MixtureOrder":
        """The same blend with a walk of its own (a reader at other positions than the loader's
        thread does not send that one back to position 0)."""
        other = MixtureOrder(self.parts, self.exhausted, self.stages[1:])
        other._base = self._base
        return other

    def walk_state(self, position: int) -> dict:
        """The walk at `position` (the loader saves it with the step): a resume starts its walk
        there (`start_from`) instead of at 0."""
        with self._lock:
            self._walk_unlocked(position, position)
            return dict(position=position, counts=list(self._counts),
                        stage_counts=list(self._stage_counts))  # fmt: skip

    def start_from(self, state: dict) -> None:
        with self._lock:
            self._base = {k: v if k == "position" else list(v) for k, v in state.items()}
            self._restart(state["position"])

    def counts_at(self, position: int) -> list[int]:
        """How many of positions [0, position) each source holds."""
        with self._lock:
            self._walk_unlocked(position, position)
            return list(self._counts)

    def _walk(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            return self._walk_unlocked(start, stop)

    def _restart(self, position: int) -> None:
        """Back to the saved walk if it lies at or before `position`, else to the start."""
        base = self._base if self._base and self._base["position"] <= position else None
        self._pos = base["position"] if base else 0  # the walk so far
        self._counts = list(base["counts"]) if base else [0] * len(self.parts)
        # ... and since its stage began
        self._stage_counts = list(base["stage_counts"]) if base else [0] * len(self.parts)

    def _stage_at(self, p: int) -> tuple[int, list[float], int]:
        """(first position, weights, first position of the next) of the stage holding p."""
        k = max(i for i, (start, _) in enumerate(self.stages) if start <= p)
        nxt = self.stages[k + 1][0] if k + 1 < len(self.stages) else None
        return self.stages[k][0], self.stages[k][1], nxt

    def _walk_unlocked(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within that source's order) of positions [start, stop)."""
        if start < self._pos:
            self._restart(start)
        sources, within = [], []  # of [start, stop) only: the walk to start keeps nothing
        c, sc, at = self._counts, self._stage_counts, self._pos
        while at < stop:  # stage by stage
            begin, w, end = self._stage_at(at)
            if at == begin:
                sc[:] = [0] * len(sc)
            upto = stop if end is None else min(stop, end)
            for p in range(at, upto):
                q, k = p - begin + 1, 0
                for j in range(1, len(w)):  # the first source furthest behind its share
                    if w[j] * q - sc[j] > w[k] * q - sc[k]:
                        k = j
                if p >= start:
                    sources.append(k)
                    within.append(c[k])
                c[k] += 1
                sc[k] += 1
            at = upto
        self._pos = stop
        return np.array(sources, dtype=np.int64), np.array(within, dtype=np.int64)

    def sources(self, start: int, stop: int) -> np.ndarray:
        """The source index of each position in [start, stop)."""
        return self._walk(start, stop)[0]

    def _located(self, start: int, stop: int):
        sources, within = self._walk(start, stop)
        for k, part in enumerate(self.parts):
            mine = within[sources == k]
            if len(mine) == 0:
                continue
            n = part.order.n
            if mine[-1] >= n and self.exhausted == "stop":
                raise ConfigError(
                    f"mixture source {part.name!r} ran out of its {n} samples at blend position "
                    f"{start + int(np.nonzero(sources == k)[0][np.argmax(mine >= n)])} "
                    "(training.mixture_exhausted = stop)"
                )
        return sources, within

    def samples(self, start: int, stop: int) -> np.ndarray:
        """Sample ids of positions [start, stop): each source's own, offset by its `base`."""
        sources, within = self._located(start, stop)
        out = np.empty(len(sources), dtype=np.int64)
        for k, part in enumerate(self.parts):
            at = sources == k
            if at.any():
                out[at] = part.base + part.order.samples_at(within[at])
        return out

    def take(self, start: int, stop: int) -> list[np.ndarray]:
        sources, within = self._located(start, stop)
        rows = [None] * len(sources)
        for k, part in enumerate(self.parts):
            at = np.nonzero(sources == k)[0]
            if len(at) == 0:
                continue
            n, first, last = part.order.n, int(within[at[0]]), int(within[at[-1]])
            for epoch in range(first // n + 1, last // n + 1):  # epochs begun in these rows
                where = start + int(at[np.argmax(within[at] >= epoch * n)])
                logger.info(
                    "mixture source %r: epoch %d of its %d samples begins at blend position %d",
                    part.name, epoch, n, where,
                )  # fmt: skip
            for i, sample in zip(at, part.order.samples_at(within[at]), strict=True):
                rows[i] = part.order.get(int(sample))
        return rows
