"""Llama 3's Hugging Face layout (LlamaForCausalLM): the decoder's key map and its config.json,
for the family-neutral converter in titanlite/hf.py."""

from titanlite.hf import HFFormat
from titanlite.models.decoder.hf import GLOBAL_KEYS, LAYER_KEYS, ROPE_KEYS, decoder_config


def llama_config(args, dtype: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **decoder_config(args, dtype),
        "mlp_bias": False,
    }


LLAMA_HF = HFFormat(
    model_type="llama",
    layer_keys=LAYER_KEYS,
    global_keys=GLOBAL_KEYS,
    rope_keys=ROPE_KEYS,
    config=llama_config,
)
