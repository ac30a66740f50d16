"""What a resumed run needs besides weights, optimizer, data position and RNG (the checkpoint
manager saves each rank's RNG states itself)."""

from dataclasses import dataclass, field


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    elapsed_s: float = 0.0
    # The loss spike guard's window (titanlite.bad_steps): the last steps' global losses.
    recent_losses: list[float] = field(default_factory=list)

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "skipped_steps": self.skipped_steps,
            "elapsed_s": self.elapsed_s,
            "recent_losses": list(self.recent_losses),
        }

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])
        self.tokens_seen = int(sd["tokens_seen"])
        self.skipped_steps = int(sd["skipped_steps"])
        self.elapsed_s = float(sd["elapsed_s"])
        self.recent_losses = [float(x) for x in sd["recent_losses"]]
