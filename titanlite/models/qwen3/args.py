"""Qwen3 (dense) hyperparameters and the flavor table (data, not code).

Qwen3 is the Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) with QK-norm, an explicit head_dim
(n_heads * head_dim need not be dim), an explicit FFN width, RoPE theta 1e6 without scaling,
RMSNorm eps 1e-6, and the output tied to the embedding in the small flavors.
"""

from dataclasses import dataclass, replace
from typing import ClassVar

from titanlite.config import ConfigError


@dataclass
class Qwen3Args:
    family_name: ClassVar[str] = "qwen3"  # the family these args are of (its HF layout)
    qk_norm: ClassVar[bool] = True  # RMSNorm of each head's q and k before RoPE
    use_scaled_rope: ClassVar[bool] = False  # plain RoPE at theta 1e6
    rope_scaling: ClassVar[None] = None  # config.json's (none)

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden_dim: int
    tie_embeddings: bool = False
    vocab_size: int = 0  # 0 = not set yet: the trainer fills it from the tokenizer (pad_vocab)
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 2048
    # Document masking, as Llama's args (titanlite/models/llama/args.py) describe it.
    document_masking: bool = False
    attention_backend: str = "sdpa"
    bos_id: int = -1
    eos_id: int = -1

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.document_masking and min(self.bos_id, self.eos_id) < 0:
            raise ConfigError("document_masking needs the tokenizer's bos_id and eos_id")
        if self.attention_backend not in ("sdpa", "flex"):
            raise ConfigError(f"attention_backend is sdpa or flex, not {self.attention_backend}")

    @property
    def num_kv_heads(self) -> int:
        return self.n_kv_heads


# The published shapes (the Qwen3 release's config.json files); 0.6B-4B tie the output.
QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    # n_heads * head_dim (512) is not dim (256), as in every published flavor.
    "debugmodel": Qwen3Args(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64,
                            ffn_hidden_dim=768),
    "debugmodel_tied": Qwen3Args(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64,
                                 ffn_hidden_dim=768, tie_embeddings=True),
    "0.6B": Qwen3Args(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
                      ffn_hidden_dim=3072, tie_embeddings=True),
    "1.7B": Qwen3Args(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
                      ffn_hidden_dim=6144, tie_embeddings=True),
    "4B": Qwen3Args(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
                    ffn_hidden_dim=9728, tie_embeddings=True),
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
                    ffn_hidden_dim=12288),
    "14B": Qwen3Args(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, head_dim=128,
                     ffn_hidden_dim=17408),
    "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128,
                     ffn_hidden_dim=25600),
}  # fmt: skip


def get_model_args(
    flavor: str, vocab_size: int, max_seq_len: int, use_scaled_rope: bool = False, **overrides
) -> Qwen3Args:
    """The flavor's args with the run's vocab and sequence length (and `overrides`)."""
    if flavor not in QWEN3_FLAVORS:
        raise ConfigError(f"unknown qwen3 flavor {flavor!r}; available: {', '.join(QWEN3_FLAVORS)}")
    if use_scaled_rope:
        raise ConfigError("qwen3 uses plain RoPE (theta 1e6): drop --model.use_scaled_rope")
    return replace(
        QWEN3_FLAVORS[flavor], vocab_size=vocab_size, max_seq_len=max_seq_len, **overrides
    )
