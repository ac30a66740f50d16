"""Llama 3 (Meta's architecture, plain PyTorch), registered as model.name "llama3": the shared
decoder (titanlite/models/decoder/) with Llama 3's args, flavors and HF layout."""

from titanlite.models import register
from titanlite.models.decoder import decoder_family
from titanlite.models.llama.args import LLAMA3_FLAVORS, get_model_args
from titanlite.models.llama.hf import LLAMA_HF

LLAMA3 = register(decoder_family("llama3", LLAMA3_FLAVORS, get_model_args, LLAMA_HF))
