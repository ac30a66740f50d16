"""The seed checkpoint (`--checkpoint.create_seed_checkpoint`): step 0's weights, drawn and
written one tensor at a time in one process, as a checkpoint any layout can start from."""

import logging
import os
import pickle
import shutil
from functools import partial
from pathlib import Path

import torch

from titanlite.checkpoint.layout import publish
from titanlite.checkpoint.stream import LazyTensor, save_lazily
from titanlite.checks import check_output_folders
from titanlite.config import JobConfig
from titanlite.config_parse import dump_toml
from titanlite.job import resolve_model
from titanlite.models import get_family
from titanlite.models.tiled_init import fill_

logger = logging.getLogger("titanlite")


def write_seed_checkpoint(cfg: JobConfig) -> int:
    """Step 0, weights only, written one tensor at a time (memory: the largest tensor, at any
    model size): the weights every layout draws for this seed, as a checkpoint to start from."""
    args = resolve_model(cfg).args
    check_output_folders(cfg)
    with torch.device("meta"):
        model = get_family(cfg.model.name).model_cls(args)
    seed = cfg.debug.seed

    def drawn(name, shape):
        t = torch.empty(shape)
        fill_(t, model.param_init(name), seed=seed, key=name, global_shape=shape)
        return t

    weights = {
        name: LazyTensor(tuple(p.shape), torch.float32, partial(drawn, name, p.shape))
        for name, p in model.named_parameters()
    }
    meta = {"step": 0, "model_only": True, "dp_degree": 1, "world_size": 1}
    folder = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
    shutil.rmtree(folder / "step-0.tmp", ignore_errors=True)  # a crashed earlier attempt
    save_lazily(
        {"model": weights, "meta": pickle.dumps(meta)}, folder / "step-0.tmp", "seed checkpoint"
    )
    path = publish(folder, 0)
    dump_toml(cfg, os.path.join(cfg.job.dump_folder, "config.toml"))  # conversion reads it
    logger.info("seed checkpoint written: %s (%s parameters)", path, f"{model.num_params(False):,}")
    return 0
