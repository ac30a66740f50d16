"""Worker: a train.py run on every rank that prints, as one JSON line per rank, the most bytes of
FSDP's unsharded gradients alive at once (read as each FSDP unit's backward ends, when they
peak) beside the estimator's figure for that rank (memory_estimate.fsdp_grad_bytes).

argv[1:] are train.py's arguments.
"""

import json
import sys

import torch
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

import train
from titanlite.config_parse import parse_args
from titanlite.distributed import destroy, init_distributed
from titanlite.memory_estimate import fsdp_grad_bytes, param_counts
from titanlite.plan.shape import setup_from_config

groups: list[FSDPParamGroup] = []
peak = [0]


def unsharded_grad_bytes() -> int:
    """Gradients FSDP holds unsharded: not yet upcast (.grad), or accumulated in its reduce
    dtype while gradient sync is off."""
    total = 0
    for group in groups:
        for fsdp_param in group.fsdp_params:
            grads = (fsdp_param._unsharded_param.grad, fsdp_param.unsharded_accumulated_grad)
            total += sum(g.numel() * g.element_size() for g in grads if g is not None)
    return total


def recording(init, post_backward):
    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        groups.append(self)

    def recording_post_backward(self, *args, **kwargs):
        peak[0] = max(peak[0], unsharded_grad_bytes())
        return post_backward(self, *args, **kwargs)

    return recording_init, recording_post_backward


if __name__ == "__main__":
    FSDPParamGroup.__init__, FSDPParamGroup.post_backward = recording(
        FSDPParamGroup.__init__, FSDPParamGroup.post_backward
    )
    cfg = parse_args(sys.argv[1:])
    dist_env = init_distributed()
    rank, _, world, _ = dist_env
    torch.manual_seed(cfg.debug.seed)
    trainer = train.Trainer(cfg, dist_env)
    trainer.train()
    setup = setup_from_config(cfg, world, trainer.model_args, "cpu", rank=rank)
    estimated = fsdp_grad_bytes(param_counts(trainer.model_args), setup)
    print(json.dumps({"rank": rank, "measured": peak[0], "estimated": estimated}))
    trainer.close()
    destroy()
