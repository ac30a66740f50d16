"""The Llama-style decoder that families build on (Llama 3, Qwen3): the plain model (model.py),
its parallel recipe and initialization (parallelize.py, context_parallel.py, tp_loss.py), its
pipeline cut (pipeline.py) and Hugging Face names (hf.py). Family-neutral: the families import
it, it imports no family, and a family's args choose its shapes and options (see model.py)."""

from torch import nn

from titanlite.metrics import num_flops_per_token
from titanlite.models import ModelFamily
from titanlite.models.decoder.model import Transformer
from titanlite.models.decoder.parallelize import (
    TP_SPLIT,
    apply_tp,
    init_weights_parallel,
    parallelize_decoder,
)


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


def decoder_family(name: str, flavors, model_args, hf, **extra):
    """The ModelFamily record of a family built on this decoder: its name, flavors, args and HF
    format, the decoder's model, parallel recipe, pipeline cut and FLOPs, plus `extra` fields
    (e.g. the estimator's `extra_saved_per_token`)."""
    return ModelFamily(
        name=name,
        flavors=flavors,
        model_args=model_args,
        model_cls=Transformer,
        parallelize=parallelize_decoder,
        init_weights=init_weights_parallel,
        pipeline=pipeline_decoder,
        tensor_parallel=apply_tp,
        flops_per_token=num_flops_per_token,
        hf=hf,
        tp_split=TP_SPLIT,
        **extra,
    )
