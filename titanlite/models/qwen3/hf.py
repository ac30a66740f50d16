"""Qwen3's Hugging Face layout (Qwen3ForCausalLM): the decoder's names plus the QK-norm weights,
whose entries follow RoPE's row order (each is one head's width, rotated after the norm)."""

from titanlite.hf import HFFormat
from titanlite.models.decoder.hf import GLOBAL_KEYS, LAYER_KEYS, ROPE_KEYS, decoder_config

QK_NORM_KEYS = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}


def qwen3_config(args, dtype: str) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **decoder_config(args, dtype),
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
    }


QWEN3_HF = HFFormat(
    model_type="qwen3",
    layer_keys={**LAYER_KEYS, **QK_NORM_KEYS},
    global_keys=GLOBAL_KEYS,
    rope_keys={**ROPE_KEYS, **dict.fromkeys(QK_NORM_KEYS, "head")},
    config=qwen3_config,
)
