"""The dry run: one rank of the target world built over a fake process group, in one process
(its rehearsal, real steps of that rank: titanlite/rehearsal.py)."""

import json
import logging
import resource
import time
from pathlib import Path

from titanlite.build import build_model, count_params, init_model
from titanlite.config import JobConfig
from titanlite.distributed import destroy, init_fake_distributed, local_value
from titanlite.job import World, resolve_job
from titanlite.memory_estimate import GIB, estimate
from titanlite.models.pipeline_plan import PipelinePlan
from titanlite.optim import build_optimizer, state_bytes
from titanlite.parallel_dims import ParallelDims
from titanlite.plan.shape import setup_from_config
from titanlite.precision import resolve_param_dtype

logger = logging.getLogger("titanlite")


def dry_run(cfg: JobConfig) -> int:
    """Play rank comm.fake_rank of comm.fake_world_size over a fake process group: every check of
    the real job, the mesh, parallelize, and this rank's shards allocated and initialized for
    real; report the per-rank figures and write {dump_folder}/dry_run.json. No data, no step."""
    comm = cfg.comm
    dist_env = init_fake_distributed(comm.fake_rank, comm.fake_world_size)
    rank, _, world, device = dist_env
    job = resolve_job(cfg, World(world))  # no device: its CPU plays the job's GPUs
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
