"""The run's one optimizer over every parameter group, each group stepped by its own optimizer."""

from collections import defaultdict

import torch

from titanlite.optim.adamw_bf16 import AdamWBf16States
from titanlite.optim.closure import closure_loss
from titanlite.optim.groups import assign_groups
from titanlite.optim.muon import Muon


class GroupedOptimizer(torch.optim.Optimizer):
    """One torch Optimizer over the groups of several inner ones (name -> AdamW, Adam or Muon
    optimizer). It is what the LR scheduler drives (every group), checkpoints save (one state
    dict, DCP reshards it), StepInBackward steps one parameter at a time: each step hands every
    inner optimizer its current groups and the shared state, so replaced group dicts
    (load_state_dict, StepInBackward) are always the ones stepped. Groups are told apart by
    their parameters, not by a key of their own: the saved groups are torch's, so checkpoints
    of AdamW runs from before parameter groups still load."""

    def __init__(self, inner: dict[str, torch.optim.Optimizer]):
        self.inner = inner
        self._name_of = {p: name for name, o in inner.items() for g in o.param_groups
                         for p in g["params"]}  # fmt: skip
        super().__init__([g for opt in inner.values() for g in opt.param_groups], {})
        for opt in inner.values():
            opt.state = self.state

    def optimizer_of(self, group: dict) -> str:
        """The name of the inner optimizer that steps `group`."""
        return self._name_of[group["params"][0]]

    def _hand_over(self) -> None:
        """Each inner optimizer gets its current groups and the shared state (load_state_dict
        and StepInBackward replace them)."""
        for name, opt in self.inner.items():
            opt.param_groups = [g for g in self.param_groups if self.optimizer_of(g) == name]
            opt.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        self._hand_over()
        for opt in self.inner.values():
            opt.step()
        return loss

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._hand_over()
        for opt in self.inner.values():
            if isinstance(opt, AdamWBf16States):
                opt.restore_dtypes()


def build_optimizer(model: torch.nn.Module, cfg) -> GroupedOptimizer:
    """The optimizer of the [optimizer] section `cfg` over the model's trainable parameters, in
    the groups of titanlite.optim.groups."""
    by_optimizer = defaultdict(list)
    for group in assign_groups(model, cfg, whole_model=False):
        by_optimizer[group.pop("optimizer")].append(group)
    return GroupedOptimizer(
        {name: _inner(name, groups, cfg) for name, groups in by_optimizer.items()}
    )


def state_bytes(optimizer: GroupedOptimizer) -> int:
    """Bytes of the states `optimizer` keeps once stepped, at the parameters' global sizes: two
    moments per Adam(W) parameter (bf16 with AdamWBf16States), one momentum buffer per Muon
    one."""
    total = 0
    for name, inner in optimizer.inner.items():
        moments = 1 if name == "Muon" else 2
        size = 2 if isinstance(inner, AdamWBf16States) else None
        for p in (p for g in inner.param_groups for p in g["params"]):
            total += moments * p.numel() * (size or p.element_size())
    return total


def _inner(name: str, groups: list[dict], cfg) -> torch.optim.Optimizer:
    for g in groups:  # a group's betas are one setting to torch
        if name != "Muon":
            g["betas"] = (g.pop("beta1"), g.pop("beta2"))
    if name == "Muon":
        return Muon(
            groups, nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps,
            adjust_lr_fn=cfg.muon_adjust_lr,
        )  # fmt: skip
    if name == "AdamW" and cfg.state_dtype == "bfloat16":
        return AdamWBf16States(groups)
    params = [p for g in groups for p in g["params"]]
    impl = {  # the config's choices for optimizer.implementation
        "foreach": {"foreach": True},
        "fused": {"fused": True},
        "for-loop": {"foreach": False},
    }[resolve_implementation(cfg.implementation, params)]
    cls = torch.optim.AdamW if name == "AdamW" else torch.optim.Adam
    return cls(groups, **impl)


def resolve_implementation(choice: str, params: list[torch.Tensor]) -> str:
    """ "auto": fused where every parameter is on one device, CUDA or CPU (the whole update in
    one fused kernel; torchtitan's default): on a CPU the update alone is 2-4x faster than
    foreach (the debug model, 2 threads: 11 against 39 ms). Parameters split between devices
    (CPU offload of some) get foreach, which takes any mix."""
    if choice != "auto":
        return choice
    devices = {p.device.type for p in params}
    return "fused" if devices in ({"cuda"}, {"cpu"}) else "foreach"
