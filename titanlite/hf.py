"""The Hugging Face format, family-neutral: the converter a family's key map drives, the RoPE row
order, config.json and safetensors files.

titanlite's state-dict keys are Meta's (`layers.N.attention.wq.weight`), HF's are
`model.layers.N.self_attn.q_proj.weight`: conversion is a key map plus one row permutation, and
each family gives its own `HFFormat` (its record's `hf`: the key map and config.json).
RoPE: titanlite (like Meta) rotates interleaved pairs (2i, 2i+1) of each head; HF's rotate_half
pairs i with i + head_dim/2. The rows of the weights whose outputs are rotated (q/k projections,
and a per-head norm before the rotation) are permuted within each head so both give the same
logits. Used by scripts/convert_checkpoint.py and by the trainer's checkpoints
(`titanlite.checkpoint.hf`); nothing here knows about ranks.
"""

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from titanlite.config import ConfigError

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
EMBEDDING, OUTPUT = "tok_embeddings.weight", "output.weight"
# The head count whose rows a RoPE-permuted weight holds, by kind: the query heads, the
# key-value heads, or one head (a per-head norm's weight, shared by every head).
ROPE_HEADS = {
    "q": lambda n_heads, n_kv: n_heads,
    "kv": lambda n_heads, n_kv: n_kv,
    "head": lambda n_heads, n_kv: 1,
}


def to_hf_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's rows (dim 0; a 1-D weight is one column) from interleaved pairs to
    HF's two halves."""
    rows = w.shape[0]
    # [h*hd, c] -> [h, hd/2, 2, c] -> [h, 2, hd/2, c] -> [h*hd, c]
    pairs = w.reshape(n_heads, rows // n_heads // 2, 2, -1)
    return pairs.transpose(1, 2).reshape(w.shape)


def from_hf_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows = w.shape[0]
    # [h*hd, c] -> [h, 2, hd/2, c] -> [h, hd/2, 2, c] -> [h*hd, c]
    halves = w.reshape(n_heads, 2, rows // n_heads // 2, -1)
    return halves.transpose(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class HFFormat:
    """A family's Hugging Face layout: titanlite name -> HF name (per layer, prefixed
    "model.layers.N.", and global), the RoPE-permuted weights, config.json. A model whose
    `args.tie_embeddings` is set has no output weight, and its HF files no lm_head."""

    model_type: str  # config.json's model_type
    layer_keys: Mapping[str, str]
    global_keys: Mapping[str, str]
    rope_keys: Mapping[str, str]  # layer key -> its kind in ROPE_HEADS
    config: Callable[[object, str], dict]  # (args, dtype name) -> config.json

    def hf_name(self, ours: str, n_heads: int, n_kv_heads: int):
        """The HF name of a titanlite weight, and its RoPE head count if its rows are
        permuted."""
        if ours in self.global_keys:
            return self.global_keys[ours], None
        _, i, rest = ours.split(".", 2)
        kind = self.rope_keys.get(rest)
        heads = None if kind is None else ROPE_HEADS[kind](n_heads, n_kv_heads)
        return f"model.layers.{i}.{self.layer_keys[rest]}", heads

    def names(self, args, ours_names) -> dict[str, tuple[str, int | None]]:
        """{titanlite name: (HF name, RoPE head count or None)}."""
        return {o: self.hf_name(o, args.n_heads, args.num_kv_heads) for o in ours_names}

    def titanlite_names(self, n_layers: int) -> list[str]:
        return [
            *self.global_keys,
            *(f"layers.{i}.{k}" for i in range(n_layers) for k in self.layer_keys),
        ]

    def units(self, args) -> list[list[str]]:
        """Export units, each one safetensors file: the embedding, each block, then norm +
        output (norm alone when the output is the embedding)."""
        head = [k for k in self.global_keys if k != EMBEDDING]
        if args.tie_embeddings:
            head.remove(OUTPUT)
        return [
            [EMBEDDING],
            *([f"layers.{i}.{k}" for k in self.layer_keys] for i in range(args.n_layers)),
            head,
        ]

    def to_hf(self, sd: dict, args, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """HF names and layout for whichever titanlite weights `sd` holds (a unit or the
        model)."""
        out = {}
        for ours, w in sd.items():
            hf, heads = self.hf_name(ours, args.n_heads, args.num_kv_heads)
            out[hf] = (w if heads is None else to_hf_rope(w, heads)).to(dtype).contiguous()
        return out

    def from_hf_lazily(self, get, cfg: dict, dtype: torch.dtype) -> dict[str, tuple]:
        """{titanlite name: (HF name, make)} where make() converts `get(HF name)`."""
        n_heads = cfg["num_attention_heads"]
        n_kv = cfg.get("num_key_value_heads") or n_heads
        tied = bool(cfg.get("tie_word_embeddings"))

        def converter(name: str, heads: int | None):
            def make() -> torch.Tensor:
                w = get(name)
                return (w if heads is None else from_hf_rope(w, heads)).to(dtype).contiguous()

            return make

        out = {}
        for ours in self.titanlite_names(cfg["num_hidden_layers"]):
            if tied and ours == OUTPUT:
                continue  # the model's output reads the embedding's weight (no parameter)
            name, heads = self.hf_name(ours, n_heads, n_kv)
            out[ours] = name, converter(name, heads)
        return out

    def write_config(self, out: Path, args, dtype: str) -> None:
        (out / CONFIG).write_text(json.dumps(self.config(args, dtype), indent=2) + "\n")


def rope_parameters(args) -> dict:
    """config.json's RoPE keys (transformers >= 5 reads rope_parameters, older ones the rest)."""
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling:
        rope = {**args.rope_scaling, "rope_theta": args.rope_theta}
    return {
        "rope_theta": args.rope_theta,
        "rope_scaling": args.rope_scaling,
        "rope_parameters": rope,
    }


def read_hf_config(hf_dir: Path) -> dict:
    """config.json of a HF folder with safetensors weights (ConfigError otherwise)."""
    cfg_file = hf_dir / CONFIG
    if not cfg_file.is_file() or not any(hf_dir.glob("*.safetensors")):
        raise ConfigError(f"{hf_dir} needs config.json and *.safetensors (a HF checkpoint)")
    return json.loads(cfg_file.read_text())


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
