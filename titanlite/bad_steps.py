"""Steps that must not be trained on, found at the step's one host sync: non-finite values
(training.on_nonfinite) and loss spikes (training.loss_spike_factor; off by default).

A non-finite loss or grad norm stops the run with the step named, or skips its update. A step
whose loss exceeds factor x the mean loss of the last `window` steps is reported with the data it
trained on, and with `training.on_loss_spike skip` its update is not taken. Both judge global
values (the grad norm over every rank; every rank's summed loss over the step's target tokens),
the same numbers on every rank, so every rank decides alike. The spike mean runs over steps that
were not spikes, so a spike does not raise the bar for the next one; it lives in the train
state, so a resumed run judges as the uninterrupted run would.
"""

import logging

logger = logging.getLogger("titanlite")


class NonFiniteError(RuntimeError):
    pass


def on_nonfinite(loss: float, grad_norm: float, state, cfg, early: bool) -> None:
    """Skip the step (on_nonfinite skip) or stop the run. `early`: the update was already taken
    in backward (the config refuses on_nonfinite skip with it)."""
    taken = "already taken in backward, with those gradients" if early else "not taken"
    msg = (
        f"non-finite values at step {state.step + 1}: loss {loss:.6g}, grad norm "
        f"{grad_norm:.6g}; the optimizer step was {taken}"
    )
    if cfg.training.on_nonfinite == "skip":
        state.skipped_steps += 1
        logger.warning("%s (skipped; %d skipped so far)", msg, state.skipped_steps)
        return
    skip = "" if early else ", or set --training.on_nonfinite skip"
    raise NonFiniteError(
        f"{msg}. The last checkpoint is untouched. Lower optimizer.lr or check the data{skip}."
    )


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
