"""Worker: several train.py jobs in a row in one process or one torchrun launch, which saves each
job the start of its own processes (seconds, times dozens of jobs in the suite).

argv[1] is a JSON list of jobs: a list of train.py arguments (the job runs as train.main runs
it: logging as train.main sets it up, seeded, then Trainer, train, close; a seed checkpoint job,
one process only, runs train.main itself), or {"copy": [src, dst]}: rank 0 copies a checkpoint
folder and the others wait for it.
"""

import json
import shutil
import sys

import torch
import torch.distributed as dist

import train
from titanlite.config_parse import parse_args
from titanlite.distributed import destroy, init_distributed
from titanlite.metrics import init_logger


def main(jobs: list) -> None:
    dist_env = init_distributed()
    init_logger(dist_env[0])
    for job in jobs:
        if isinstance(job, dict):
            if dist_env[0] == 0:
                shutil.copytree(*job["copy"])
            dist.barrier()
            continue
        cfg = parse_args(job)
        if cfg.checkpoint.create_seed_checkpoint:
            assert train.main(job) == 0, job
            continue
        torch.manual_seed(cfg.debug.seed)
        trainer = train.Trainer(cfg, dist_env)
        trainer.train()
        trainer.close()
    destroy()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
