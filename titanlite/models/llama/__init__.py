"""Llama 3 (Meta's architecture, plain PyTorch), registered as model.name "llama3": the shared
decoder (titanlite/models/decoder/) with Llama 3's args, flavors and HF layout."""

from titanlite.metrics import num_flops_per_token
from titanlite.models import ModelFamily, register
from titanlite.models.decoder import pipeline_decoder
from titanlite.models.decoder.model import Transformer
from titanlite.models.decoder.parallelize import (
    TP_SPLIT,
    apply_tp,
    init_weights_parallel,
    parallelize_decoder,
)
from titanlite.models.llama.args import LLAMA3_FLAVORS, get_model_args
from titanlite.models.llama.hf import LLAMA_HF

LLAMA3 = register(
    ModelFamily(
        name="llama3",
        flavors=LLAMA3_FLAVORS,
        model_args=get_model_args,
        model_cls=Transformer,
        parallelize=parallelize_decoder,
        init_weights=init_weights_parallel,
        pipeline=pipeline_decoder,
        tensor_parallel=apply_tp,
        flops_per_token=num_flops_per_token,
        hf=LLAMA_HF,
        tp_split=TP_SPLIT,
    )
)
