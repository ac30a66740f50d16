"""Qwen3's Hugging Face layout (Qwen3ForCausalLM): Llama's names plus the QK-norm weights, whose
entries follow RoPE's row order (each is one head's width, rotated after the norm)."""

from dataclasses import replace

from titanlite.models import get_family

LLAMA_HF = get_family("llama3").hf  # HF names Qwen3's shared decoder parts as it names Llama's

QWEN3_HF = replace(
    LLAMA_HF,
    model_type="qwen3",
    layer_keys={
        **LLAMA_HF.layer_keys,
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
    },
    rope_keys={
        **LLAMA_HF.rope_keys,
        "attention.q_norm.weight": "head",
        "attention.k_norm.weight": "head",
    },
    config=lambda args, dtype: qwen3_config(args, dtype),
)


def qwen3_config(args, dtype: str) -> dict:
    cfg = {
        **LLAMA_HF.config(args, dtype),
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
    }
    del cfg["mlp_bias"]
    return cfg
