"""Llama 3 (Meta's architecture, plain PyTorch), registered as model.name "llama3"."""

from torch import nn

from titanlite.metrics import num_flops_per_token
from titanlite.models import ModelFamily, register
from titanlite.models.llama.args import LLAMA3_FLAVORS, get_model_args
from titanlite.models.llama.hf import LLAMA_HF
from titanlite.models.llama.model import Transformer
from titanlite.models.llama.parallelize import (
    TP_SPLIT,
    apply_tp,
    init_weights_parallel,
    parallelize_llama,
)


def pipeline_llama(model, plan, parallel_dims, prepare_stage, device) -> nn.Module:
    """This rank's stages of the meta model, each prepared (parallelized and allocated)."""
    # Imported here, not at the top: torch.distributed.pipelining's import loads torch._dynamo
    # (~0.5 s on a 2-core CPU), which the planner, the estimator and the job checks, importing
    # this family, do not need. (A training run loads torch._dynamo anyway: torch's optimizers
    # do at their first step.)
    from titanlite.models.llama.pipeline import PipelinedModel, cut_stages, tied_group

    pd = parallel_dims
    ids, stages = cut_stages(model, plan, pd.pp_mesh, pd.tp_mesh)
    tied = tied_group(pd.world_mesh, pd.pp_mesh) if model.args.tie_embeddings else None
    stages = [prepare_stage(s) for s in stages]
    return PipelinedModel(stages, ids, plan, pd.pp_mesh, device, tied)


LLAMA3 = register(
    ModelFamily(
        name="llama3",
        flavors=LLAMA3_FLAVORS,
        model_args=get_model_args,
        model_cls=Transformer,
        parallelize=parallelize_llama,
        init_weights=init_weights_parallel,
        pipeline=pipeline_llama,
        tensor_parallel=apply_tp,
        flops_per_token=num_flops_per_token,
        hf=LLAMA_HF,
        tp_split=TP_SPLIT,
    )
)
