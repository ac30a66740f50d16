"""The Hugging Face Llama format: tensor names, the RoPE row order, config.json, safetensors files.

titanlite's state-dict keys are Meta's (`layers.N.attention.wq.weight`), HF's are
`model.layers.N.self_attn.q_proj.weight`: conversion is a key map plus one row permutation.
RoPE: titanlite (like Meta) rotates interleaved pairs (2i, 2i+1) of each head; HF's rotate_half
pairs i with i + head_dim/2. The q/k projection rows are permuted within each head so both give
the same logits. Used by scripts/convert_checkpoint.py and by the trainer's checkpoints
(`titanlite.checkpoint.hf`); nothing here knows about ranks. `args` is the llama3 family's
ModelArgs.
"""

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from titanlite.config import ConfigError

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"

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


def to_hf_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's rows from interleaved pairs to HF's two halves."""
    rows, cols = w.shape
    # [h*hd, dim] -> [h, hd/2, 2, dim] -> [h, 2, hd/2, dim] -> [h*hd, dim]
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def from_hf_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    # [h*hd, dim] -> [h, 2, hd/2, dim] -> [h, hd/2, 2, dim] -> [h*hd, dim]
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_name(ours: str, n_heads: int, n_kv_heads: int) -> tuple[str, int | None]:
    """The HF name of a titanlite weight, and its RoPE head count if its rows are permuted."""
    if ours in GLOBAL_KEYS:
        return GLOBAL_KEYS[ours], None
    _, i, rest = ours.split(".", 2)
    heads = {"attention.wq.weight": n_heads, "attention.wk.weight": n_kv_heads}.get(rest)
    return f"model.layers.{i}.{LAYER_KEYS[rest]}", heads


def titanlite_names(n_layers: int) -> list[str]:
    return [
        *GLOBAL_KEYS,
        *(f"layers.{i}.{k}" for i in range(n_layers) for k in LAYER_KEYS),
    ]


def units(n_layers: int) -> list[list[str]]:
    """Export units, each one safetensors file: the embedding, each block, then norm + output."""
    return [
        ["tok_embeddings.weight"],
        *([f"layers.{i}.{k}" for k in LAYER_KEYS] for i in range(n_layers)),
        ["norm.weight", "output.weight"],
    ]


def to_hf(sd: dict, args, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF names and layout for whichever titanlite weights `sd` holds (a unit or the model)."""
    out = {}
    for ours, w in sd.items():
        hf, rope_heads = hf_name(ours, args.n_heads, args.num_kv_heads)
        out[hf] = (w if rope_heads is None else to_hf_rope(w, rope_heads)).to(dtype).contiguous()
    return out


def from_hf_lazily(get, cfg: dict, dtype: torch.dtype) -> dict[str, tuple[str, Callable]]:
    """{titanlite name: (HF name, make)} where make() converts `get(HF name)`."""
    n_heads = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_heads

    def converter(name: str, heads: int | None):
        def make() -> torch.Tensor:
            w = get(name)
            return (w if heads is None else from_hf_rope(w, heads)).to(dtype).contiguous()

        return make

    out = {}
    for ours in titanlite_names(cfg["num_hidden_layers"]):
        name, heads = hf_name(ours, n_heads, n_kv)
        out[ours] = name, converter(name, heads)
    return out


def hf_config(args, dtype: str) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling:
        cfg["rope_scaling"] = args.rope_scaling
        rope = {**cfg["rope_scaling"], "rope_theta": args.rope_theta}
    cfg["rope_parameters"] = rope  # transformers >= 5 reads this; older ones the two keys above
    return cfg


def write_hf_config(out: Path, args, dtype: str) -> None:
    (out / CONFIG).write_text(json.dumps(hf_config(args, dtype), indent=2) + "\n")


def read_hf_config(hf_dir: Path) -> dict:
    """config.json of a HF Llama folder that titanlite can load (ValueError otherwise)."""
    cfg_file = hf_dir / CONFIG
    if not cfg_file.is_file() or not any(hf_dir.glob("*.safetensors")):
        raise ConfigError(f"{hf_dir} needs config.json and *.safetensors (a HF Llama checkpoint)")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("tie_word_embeddings"):
        raise ConfigError(
            f"{hf_dir}: tied embeddings are not supported (titanlite's output is untied)"
        )
    return cfg


def hf_files(hf_dir: Path) -> dict[str, Path]:
    """{HF tensor name: file}, from the index when there is one, else from every file."""
    index = hf_dir / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: hf_dir / f for name, f in weight_map.items()}
    files = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in files:
                    raise ConfigError(f"{hf_dir}: {name} is in both {files[name].name} and "
                                     f"{f.name} (and there is no index to choose)")  # fmt: skip
                files[name] = f
    return files


def read_hf_tensor(files: dict[str, Path], name: str) -> torch.Tensor:
    # Opened per tensor: the file is memory-mapped, and closing unmaps the pages just read.
    with safe_open(str(files[name]), framework="pt") as st:
        return st.get_tensor(name)


def hf_shape(files: dict[str, Path], name: str) -> tuple[int, ...]:
    with safe_open(str(files[name]), framework="pt") as st:
        return tuple(st.get_slice(name).get_shape())


def to_hf_rope_in_file(path: Path, name: str, n_heads: int) -> None:
    """Permute the rows of 2-D tensor `name`, stored in titanlite's order in safetensors file
    `path`, into HF's, in place. Memory: two copies of that one tensor. The rows are moved as
    bytes, so any dtype works."""
    with open(path, "r+b") as f:
        header_len = int.from_bytes(f.read(8), "little")  # the safetensors layout
        entry = json.loads(f.read(header_len))[name]
        start, end = entry["data_offsets"]
        f.seek(8 + header_len + start)
        rows = torch.frombuffer(bytearray(f.read(end - start)), dtype=torch.uint8)
        rows = to_hf_rope(rows.view(entry["shape"][0], -1), n_heads)
        f.seek(8 + header_len + start)
        f.write(rows.numpy().tobytes())
