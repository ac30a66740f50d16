"""Llama 3 hyperparameters and the flavor table (data, not code)."""

import re
from dataclasses import dataclass, replace
from typing import ClassVar

from titanlite.config import ConfigError
from titanlite.models import pad_vocab  # noqa: F401 (imported from here by scripts and tests)

# Llama 3.1 RoPE scaling constants, as in Meta's reference apply_scaling.
ROPE_SCALE_FACTOR = 8.0
ROPE_LOW_FREQ_FACTOR = 1.0
ROPE_HIGH_FREQ_FACTOR = 4.0
ROPE_OLD_CONTEXT_LEN = 8192


@dataclass
class ModelArgs:
    family_name: ClassVar[str] = "llama3"  # the family these args are of (its HF layout)

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None  # None = plain multi-head attention (n_kv_heads = n_heads)
    vocab_size: int = 0  # 0 = not set yet: the trainer fills it from the tokenizer (pad_vocab)
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    use_scaled_rope: bool = False  # Llama 3.1 long-context RoPE frequency scaling
    max_seq_len: int = 2048
    # Document masking: tokens attend only within their own document of a packed sequence (as
    # Llama 3 was trained); a document starts at a bos_id right after an eos_id.
    document_masking: bool = False
    # How document masks are applied: "sdpa" (a dense mask) or "flex" (flex attention's block
    # mask: skips the blocks across documents; needs CUDA to train).
    attention_backend: str = "sdpa"
    bos_id: int = -1
    eos_id: int = -1
    # Options of the shared decoder (model.py) that Llama 3 does not use: RMSNorm of each head's
    # q and k before RoPE, and the output projection tied to the embedding.
    qk_norm: bool = False
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ConfigError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.num_kv_heads:
            raise ConfigError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"RoPE needs an even head_dim, got dim/n_heads = {self.head_dim}")
        if self.document_masking and min(self.bos_id, self.eos_id) < 0:
            raise ConfigError("document_masking needs the tokenizer's bos_id and eos_id")
        if self.attention_backend not in ("sdpa", "flex"):
            raise ConfigError(f"attention_backend is sdpa or flex, not {self.attention_backend}")
        if self.attention_backend == "flex" and not self.document_masking:
            raise ConfigError(
                "attention_backend flex only applies document masks; without document masking "
                "the plain causal SDPA kernel is the fast one: use sdpa"
            )

    @property
    def rope_scaling(self) -> dict | None:
        """Llama 3.1's RoPE frequency scaling, named as in HF's config.json (None: not scaled)."""
        if not self.use_scaled_rope:
            return None
        return {
            "rope_type": "llama3",
            "factor": ROPE_SCALE_FACTOR,
            "low_freq_factor": ROPE_LOW_FREQ_FACTOR,
            "high_freq_factor": ROPE_HIGH_FREQ_FACTOR,
            "original_max_position_embeddings": ROPE_OLD_CONTEXT_LEN,
        }

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def num_kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU width as in Meta's reference: 2/3 of 4*dim, scaled, rounded up to multiple_of."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


# Meta's published shapes. 1B/3B are Llama 3.2, trained with scaled RoPE; the rest use the flag.
LLAMA3_FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, multiple_of=256),
    "1B": ModelArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
        multiple_of=256, use_scaled_rope=True,
    ),
    "3B": ModelArgs(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0,
        multiple_of=256, use_scaled_rope=True,
    ),
    "8B": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024
    ),
    "70B": ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096
    ),
    "405B": ModelArgs(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
        multiple_of=4096,
    ),
}  # fmt: skip


# torchtitan's name for a flavor with document masking (it uses flex attention for it).
DOCUMENT_MASKING_SUFFIX = "_flex_attn"
# "8B_4L": the 8B flavor's blocks, 4 of them (a big model's block shape on one GPU).
_FEWER_LAYERS = re.compile(r"^(?P<base>.+)_(?P<layers>[1-9][0-9]*)L$")


def get_model_args(
    flavor: str, vocab_size: int, max_seq_len: int, use_scaled_rope: bool = False, **overrides
) -> ModelArgs:
    """The flavor's ModelArgs with the run's vocab and sequence length (and `overrides`).

    use_scaled_rope=True turns scaling on; flavors trained with it (1B, 3B) keep it regardless.
    A flavor named with the suffix "_flex_attn" is the base flavor with document masking; one
    named "<flavor>_<N>L" (8B_4L) has N of the base flavor's blocks.
    """
    name = flavor.removesuffix(DOCUMENT_MASKING_SUFFIX)
    if name != flavor:
        overrides["document_masking"] = True
    fewer = _FEWER_LAYERS.match(name)
    if fewer and fewer["base"] in LLAMA3_FLAVORS:
        name, overrides["n_layers"] = fewer["base"], int(fewer["layers"])
    if name not in LLAMA3_FLAVORS:
        raise ConfigError(
            f"unknown model flavor {flavor!r}; available: {', '.join(LLAMA3_FLAVORS)}, each also "
            f"with {DOCUMENT_MASKING_SUFFIX} (document masking) or _<N>L (N of its blocks)"
        )
    base = LLAMA3_FLAVORS[name]
    return replace(
        base,
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        use_scaled_rope=base.use_scaled_rope or use_scaled_rope,
        **overrides,
    )
