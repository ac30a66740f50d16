"""How Hugging Face names the decoder's weights and config (transformers' Llama and Qwen3 alike):
the key maps and config.json keys the families' HF layouts (their hf.py) start from."""

from titanlite.hf import rope_parameters

# titanlite (Meta) name -> HF name, per layer (prefixed "model.layers.N.") and global.
LAYER_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
GLOBAL_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_KEYS = {"attention.wq.weight": "q", "attention.wk.weight": "kv"}


def decoder_config(args, dtype: str) -> dict:
    """config.json keys of a HF Llama-style decoder (transformers' Llama and Qwen3 read them)."""
    return {
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        **rope_parameters(args),
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "torch_dtype": dtype,
    }
