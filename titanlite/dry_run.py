"""The whole-model jobs of one process: the dry run (one rank of the target world over a fake
process group) and the seed checkpoint (step 0's weights, one tensor at a time)."""

import json
import logging
import os
import pickle
import resource
import shutil
import time
from functools import partial
from pathlib import Path

import torch

from titanlite.build import build_model, count_params, init_model, model_args_for
from titanlite.checkpoint import publish
from titanlite.checkpoint.stream import LazyTensor, save_lazily
from titanlite.checks import check_job, check_output_folders
from titanlite.config import JobConfig
from titanlite.config_parse import dump_toml
from titanlite.data.tokenizer import build_tokenizer
from titanlite.distributed import destroy, init_fake_distributed, local_value
from titanlite.memory_estimate import GIB, estimate
from titanlite.models import get_family
from titanlite.models.llama.pipeline_plan import PipelinePlan
from titanlite.models.tiled_init import fill_
from titanlite.optim import build_optimizer, state_bytes
from titanlite.parallel_dims import ParallelDims
from titanlite.plan.shape import setup_from_config
from titanlite.precision import resolve_param_dtype

logger = logging.getLogger("titanlite")


def write_seed_checkpoint(cfg: JobConfig) -> int:
    """Step 0, weights only, written one tensor at a time (memory: the largest tensor, at any
    model size): the weights every layout draws for this seed, as a checkpoint to start from."""
    args = model_args_for(cfg, build_tokenizer(cfg.model))
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


def dry_run(cfg: JobConfig) -> int:
    """Play rank comm.fake_rank of comm.fake_world_size over a fake process group: every check of
    the real job, the mesh, parallelize, and this rank's shards allocated and initialized for
    real; report the per-rank figures and write {dump_folder}/dry_run.json. No data, no step."""
    comm = cfg.comm
    dist_env = init_fake_distributed(comm.fake_rank, comm.fake_world_size)
    rank, _, world, device = dist_env
    job = check_job(cfg, world)
    job.parallel_dims.build_mesh(device.type)
    compute_dtype = resolve_param_dtype(cfg.training.mixed_precision_param, device)
    t0 = time.perf_counter()
    model = build_model(cfg, job.model_args, job.parallel_dims, compute_dtype, device, job.pipeline)
    t1 = time.perf_counter()
    init_model(cfg, model, device, draw_weights=comm.fake_init_weights)
    t2 = time.perf_counter()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # global sizes
    optimizer = build_optimizer(model, cfg.optimizer)  # its groups: refused as the run would
    # On CUDA, the target; for this rank's pipeline stages under PP.
    setup = setup_from_config(cfg, world, job.model_args, device="cuda", rank=rank)
    report = {
        "world_size": world,
        "rank": rank,
        "layout": str(job.parallel_dims),
        "params_total": count_params(cfg, job.model_args, exclude_embedding=False),
        "params_local": sum(local_value(p).numel() for p in model.parameters()),
        "build_seconds": round(t1 - t0, 3),
        "init_seconds": round(t2 - t1, 3),
        "weights_drawn": comm.fake_init_weights,
        "estimated_peak_gib": round(estimate(setup).total / GIB, 3),
        "checkpoint_bytes": weights + state_bytes(optimizer),  # fp32 weights and the states
        "global_batch_size": job.global_batch_size,
        "microbatches": job.num_microbatches,
        "pipeline_stages": pipeline_stages(job.pipeline, job.parallel_dims),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
    }
    out = Path(cfg.job.dump_folder) / "dry_run.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    logger.info("dry run OK, rank %d of %d:\n%s\nwritten to %s",
                rank, world, json.dumps(report, indent=2), out)  # fmt: skip
    destroy()
    return 0


def pipeline_stages(plan: PipelinePlan | None, parallel_dims: ParallelDims) -> dict | None:
    """{stage: its layers as [first, last]} of this rank's pipeline stages (None without PP)."""
    if plan is None:
        return None
    pp_rank = parallel_dims.pp_mesh.get_local_rank()
    ids = plan.stage_ids(pp_rank, parallel_dims.pp)
    return {i: [plan.stage_layers[i].start, plan.stage_layers[i].stop - 1] for i in ids}
