"""The Llama-style decoder that families build on (Llama 3, Qwen3): the plain model (model.py),
its parallel recipe and initialization (parallelize.py, context_parallel.py, tp_loss.py), its
pipeline cut (pipeline.py) and Hugging Face names (hf.py). Family-neutral: the families import
it, it imports no family, and a family's args choose its shapes and options (see model.py)."""

from torch import nn


def pipeline_decoder(model, plan, parallel_dims, prepare_stage, device) -> nn.Module:
    """This rank's stages of the meta model, each prepared (parallelized and allocated): the
    ModelFamily record's `pipeline`."""
    # Imported here, not at the top: torch.distributed.pipelining's import loads torch._dynamo
    # (~0.5 s on a 2-core CPU), which the planner, the estimator and the job checks, importing
    # the families, do not need. (A training run loads torch._dynamo anyway: torch's optimizers
    # do at their first step.)
    from titanlite.models.decoder.pipeline import PipelinedModel, cut_stages, tied_group

    pd = parallel_dims
    ids, stages = cut_stages(model, plan, pd.pp_mesh, pd.tp_mesh)
    tied = tied_group(pd.world_mesh, pd.pp_mesh) if model.args.tie_embeddings else None
    stages = [prepare_stage(s) for s in stages]
    return PipelinedModel(stages, ids, plan, pd.pp_mesh, device, tied)
