"""The loss spike guard (training.loss_spike_factor; off by default).

A step whose loss exceeds factor x the mean loss of the last `window` steps is reported with the
data it trained on, and with `training.on_loss_spike skip` its optimizer step is not taken. The
loss judged is the step's global one (every rank's summed loss over the step's target tokens),
the same number on every rank, so every rank judges alike and skips the same steps. The mean
runs over steps that were not spikes, so a spike does not raise the bar for the next one; it
lives in the train state, so a resumed run judges as the uninterrupted run would.
"""

import logging

logger = logging.getLogger("titanlite")


def skips_loss_spike(loss: float, state, cfg, loader) -> bool:
    """Judge the step's global `loss` against `state`'s recent losses; report a spike with the
    data the step trained on (`loader.describe_step`). True: skip this step's update."""
    t = cfg.training
    ratio = spike_ratio(loss, state.recent_losses, t.loss_spike_factor, t.loss_spike_window)
    if ratio is None:
        return False
    skip = t.on_loss_spike == "skip"
    state.skipped_steps += skip
    logger.warning(
        "loss spike at step %d: loss %.4f is %.2fx the mean of the last %d steps; it trained on "
        "%s; the optimizer step was %s", state.step + 1, loss, ratio, t.loss_spike_window,
        loader.describe_step(state.step),
        "skipped" if skip else "taken (--training.on_loss_spike skip skips it)",
    )  # fmt: skip
    return skip


def spike_ratio(loss: float, recent: list[float], factor: float, window: int) -> float | None:
    """loss / mean(recent) if that exceeds `factor` once `recent` holds `window` losses, else
    None, and then `loss` joins `recent` (whose oldest loss leaves when it is full)."""
    if len(recent) == window:
        ratio = loss / (sum(recent) / window)
        if ratio > factor:
            return ratio
        del recent[0]
    recent.append(loss)
    return None
