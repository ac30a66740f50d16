"""AdamW with its two moments stored in bf16 (optimizer.state_dtype bfloat16): half the memory
of its states; each step computes in fp32 and rounds the moments back to bf16."""

import math

import torch

from titanlite.optim.closure import closure_loss


class AdamWBf16States(torch.optim.AdamW):
    """torch's AdamW arithmetic (decoupled decay, bias corrections), one parameter at a time,
    over bf16 moments. Elementwise, so shards (DTensors) update as whole tensors would."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad, group)
        return loss

    def _update(self, p, grad, group) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
        beta1, beta2 = group["betas"]
        lr, step = group["lr"], int(state["step"].add_(1).item())
        m = state["exp_avg"].float().lerp_(grad, 1 - beta1)
        v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        state["exp_avg"].copy_(m)
        state["exp_avg_sq"].copy_(v)
        p.mul_(1 - lr * group["weight_decay"])
        denom = (v.sqrt_() / math.sqrt(1 - beta2**step)).add_(group["eps"])
        p.addcdiv_(m, denom, value=-lr / (1 - beta1**step))

    def restore_dtypes(self) -> None:
        """After a load (torch casts loaded states to their parameter's dtype): bf16 again."""
        for p in (p for g in self.param_groups for p in g["params"]):
            for key in ("exp_avg", "exp_avg_sq"):
                if key in self.state.get(p, {}):
                    self.state[p][key] = self.state[p][key].to(torch.bfloat16)
