"""What a resumed run needs besides weights, optimizer and data position."""

from dataclasses import dataclass, field

import torch


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    elapsed_s: float = 0.0
    rng: dict = field(default_factory=dict)

    def state_dict(self) -> dict:
        # RNG states travel with the checkpoint so any future randomness (dropout, sampling)
        # resumes bitwise; today's model draws none during training.
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "skipped_steps": self.skipped_steps,
            "elapsed_s": self.elapsed_s,
            "rng": rng,
        }

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])
        self.tokens_seen = int(sd["tokens_seen"])
        self.skipped_steps = int(sd.get("skipped_steps", 0))
        self.elapsed_s = float(sd.get("elapsed_s", 0.0))
        rng = sd.get("rng", {})
        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
