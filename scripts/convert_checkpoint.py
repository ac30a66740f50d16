"""Convert titanlite checkpoints: DCP <-> Hugging Face Llama, and DCP -> one torch.save file.

    python scripts/convert_checkpoint.py dcp-to-hf outputs/checkpoint/step-1000 hf_out [--flavor 8B]
    python scripts/convert_checkpoint.py hf-to-dcp hf_dir dcp_out
        (then train with --checkpoint.initial_load_path dcp_out)
    python scripts/convert_checkpoint.py dcp-to-torch outputs/checkpoint/step-1000 model.pt [--all]

Runs in one process without a process group (DCP resharding reads any saved layout). `--dtype`
(default: checkpoint.export_dtype of the run, else float32) applies to the exported weights.

Memory: one unit at a time, whatever the model size. dcp-to-hf loads the embedding, each block,
then norm + output, and writes each as one shard (model-0000K-of-0000N.safetensors) plus
model.safetensors.index.json; hf-to-dcp reads single-file or sharded exports one tensor at a time
and writes DCP lazily; dcp-to-torch (--all too) reserves the torch.save file's space, then fills
it tensor by tensor.

RoPE: titanlite (like Meta) rotates interleaved pairs (2i, 2i+1) of each head; HF's rotate_half
pairs i with i + head_dim/2. The q/k projection rows are permuted so both give the same logits.
"""

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titanlite import precision
from titanlite.checkpoint_stream import (
    LazyTensor,
    save_lazily,
    single_process_quietly,
    torch_save_lazily,
)
from titanlite.models.llama import model as llama_model
from titanlite.models.llama.args import LLAMA3_FLAVORS, ModelArgs

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

# Training's dtype table plus float16, for export only: the fast half type for inference on GPUs
# without bf16 (pre-Ampere), which many HF Llama checkpoints use.
DTYPES = {**precision.DTYPES, "float16": torch.float16}

# titanlite (Meta) name -> HF name, per layer ("{}" = layer index) and global.
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


class _MetadataOnceReader(dcp.FileSystemReader):
    """Reads `.metadata` once: each partial `dcp.load` below would otherwise parse it again, and
    a sharded training checkpoint's metadata lists every chunk of every tensor."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        self._metadata = None

    def read_metadata(self, *args, **kwargs):
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


class DcpCheckpoint:
    """A DCP checkpoint read a few keys at a time (full tensors, any saved sharding)."""

    def __init__(self, step_dir: Path):
        if not (step_dir / ".metadata").is_file():
            raise ValueError(f"{step_dir} is not a DCP checkpoint (no .metadata)")
        self.reader = _MetadataOnceReader(step_dir)
        self.metadata = self.reader.read_metadata()
        self.tensors = {
            k: md for k, md in self.metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        }  # fmt: skip

    def load(self, keys) -> dict:
        """{key: value} for flat DCP keys ("model.norm.weight"), bytes blobs unpickled."""
        state = {k: self._empty(k) for k in keys}
        if state:
            with single_process_quietly():
                dcp.load(state, storage_reader=self.reader, no_dist=True)
        return state

    def _empty(self, key: str):
        md = self.tensors.get(key)
        return None if md is None else torch.empty(md.size, dtype=md.properties.dtype)


class DcpModel(DcpCheckpoint):
    """The model weights (keys "model.*", named without the prefix) of a DCP checkpoint."""

    def __init__(self, step_dir: Path):
        super().__init__(step_dir)
        self.shapes = {k[len("model.") :]: md.size for k, md in self.tensors.items()
                       if k.startswith("model.")}  # fmt: skip
        if not self.shapes:
            raise ValueError(f"{step_dir} holds no model weights (keys 'model.*')")

    def weights(self, names) -> dict[str, torch.Tensor]:
        return {k[len("model.") :]: v for k, v in self.load(f"model.{n}" for n in names).items()}


def run_config(step_dir: Path) -> tuple[Path, dict]:
    """The config.toml that train.py wrote for the run owning {dump}/{folder}/step-N, if any."""
    path = step_dir.resolve().parents[1] / "config.toml"
    return path, tomllib.loads(path.read_text()) if path.is_file() else {}


def model_args_for(shapes: dict, flavor: str, step_dir: Path) -> ModelArgs:
    """Shapes come from the weights; head counts, RoPE and eps from the flavor (given, or the
    one in the run's config.toml)."""
    cfg_path, cfg = run_config(step_dir)
    model_cfg = cfg.get("model", {})
    flavor = flavor or model_cfg.get("flavor")
    if flavor not in LLAMA3_FLAVORS:
        raise ValueError(
            f"need --flavor (one of {list(LLAMA3_FLAVORS)}); got {flavor!r} and {cfg_path} "
            f"{'has no model.flavor' if cfg else 'does not exist'}"
        )
    base = LLAMA3_FLAVORS[flavor]
    vocab, dim = shapes["tok_embeddings.weight"]
    n_layers = len({k.split(".")[1] for k in shapes if k.startswith("layers.")})
    if (dim, n_layers) != (base.dim, base.n_layers):
        raise ValueError(
            f"{step_dir}: weights have dim {dim}, {n_layers} layers; flavor {flavor} has "
            f"dim {base.dim}, {base.n_layers} layers"
        )
    return replace(
        base,
        vocab_size=vocab,
        use_scaled_rope=base.use_scaled_rope or bool(model_cfg.get("use_scaled_rope", False)),
        max_seq_len=int(cfg.get("training", {}).get("seq_len", base.max_seq_len)),
    )


def hf_config(args: ModelArgs, dtype: str) -> dict:
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
    if args.use_scaled_rope:
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": llama_model.ROPE_SCALE_FACTOR,
            "low_freq_factor": llama_model.ROPE_LOW_FREQ_FACTOR,
            "high_freq_factor": llama_model.ROPE_HIGH_FREQ_FACTOR,
            "original_max_position_embeddings": llama_model.ROPE_OLD_CONTEXT_LEN,
        }
        rope = {**cfg["rope_scaling"], "rope_theta": args.rope_theta}
    cfg["rope_parameters"] = rope  # transformers >= 5 reads this; older ones the two keys above
    return cfg


def to_hf(sd: dict, args: ModelArgs, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF names and layout for whichever titanlite weights `sd` holds (a unit or the model)."""
    out = {}
    for ours, w in sd.items():
        hf, rope_heads = hf_name(ours, args.n_heads, args.num_kv_heads)
        out[hf] = (w if rope_heads is None else to_hf_rope(w, rope_heads)).to(dtype).contiguous()
    return out


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


def units(n_layers: int) -> list[list[str]]:
    """Export units, each one shard: the embedding, each block, then norm + output."""
    return [
        ["tok_embeddings.weight"],
        *([f"layers.{i}.{k}" for k in LAYER_KEYS] for i in range(n_layers)),
        ["norm.weight", "output.weight"],
    ]


def dcp_to_hf(step_dir: Path, out: Path, flavor: str, dtype: str) -> None:
    ckpt = DcpModel(step_dir)
    args = model_args_for(ckpt.shapes, flavor, step_dir)
    parts = units(args.n_layers)
    shards = [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    stale = {f.name for f in out.glob("*.safetensors")} - set(shards)
    if stale:
        raise ValueError(f"{out} holds other safetensors files ({sorted(stale)[0]}, ...): "
                         "loaders would mix them in; export into an empty directory")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for names, shard in zip(parts, shards, strict=True):
        hf = to_hf(ckpt.weights(names), args, DTYPES[dtype])
        save_file(hf, str(out / shard), {"format": "pt"})
        weight_map.update(dict.fromkeys(hf, shard))
        total += sum(t.nbytes for t in hf.values())
        del hf
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(hf_config(args, dtype), indent=2) + "\n")


def hf_files(hf_dir: Path) -> dict[str, Path]:
    """{HF tensor name: file}, from the index when there is one, else from every file."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: hf_dir / f for name, f in weight_map.items()}
    files = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in files:
                    raise ValueError(f"{hf_dir}: {name} is in both {files[name].name} and "
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


def hf_to_dcp(hf_dir: Path, out: Path, dtype: str) -> None:
    cfg_file = hf_dir / "config.json"
    if not cfg_file.is_file() or not any(hf_dir.glob("*.safetensors")):
        raise ValueError(f"{hf_dir} needs config.json and *.safetensors (a HF Llama checkpoint)")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("tie_word_embeddings"):
        raise ValueError(
            f"{hf_dir}: tied embeddings are not supported (titanlite's output is untied)"
        )
    files = hf_files(hf_dir)
    convert = from_hf_lazily(lambda name: read_hf_tensor(files, name), cfg, DTYPES[dtype])
    missing = [name for name, _ in convert.values() if name not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{hf_dir}: no {missing[0]}{more}")
    model = {
        ours: LazyTensor(hf_shape(files, name), DTYPES[dtype], make)
        for ours, (name, make) in convert.items()
    }
    save_lazily({"model": model}, out)
    # Loading it into titanlite needs a model with matching shapes: --model.flavor with this dim
    # and layer count, and a tokenizer whose padded size equals the vocab below.
    print(f"wrote {out}: vocab {cfg['vocab_size']}, dim {cfg['hidden_size']}, "
          f"{cfg['num_hidden_layers']} layers")  # fmt: skip


def dcp_to_torch(step_dir: Path, out: Path, dtype: str, everything: bool) -> None:
    if everything:  # optimizer, scheduler, loader, train state too, exactly as saved
        torch_save_lazily(whole_state_lazily(DcpCheckpoint(step_dir)), out)
        return
    ckpt = DcpModel(step_dir)
    to = DTYPES[dtype]

    def make(name: str):
        return lambda: ckpt.weights([name])[name].to(to)

    # Meta key names, like consolidated.00.pth
    model = {k: LazyTensor(tuple(size), to, make(k)) for k, size in ckpt.shapes.items()}
    torch_save_lazily(model, out)


def whole_state_lazily(ckpt: DcpCheckpoint) -> dict:
    """The nested state as saved: tensors lazily, the (small) pickled blobs read now."""
    blobs = ckpt.load(k for k in ckpt.metadata.state_dict_metadata if k not in ckpt.tensors)

    def make(key: str):
        return lambda: ckpt.load([key])[key]

    flat = {
        **blobs,
        **{k: LazyTensor(tuple(md.size), md.properties.dtype, make(k))
           for k, md in ckpt.tensors.items()},
    }  # fmt: skip
    # DCP saved each flat key's path in the nested state (as its own dcp_to_torch_save uses).
    paths = ckpt.metadata.planner_data or {}
    state: dict = {}
    for key in ckpt.metadata.state_dict_metadata:
        set_element(state, paths.get(key, (key,)), flat[key])
    return state


def run_default_dtype(step_dir: Path) -> str:
    return run_config(step_dir)[1].get("checkpoint", {}).get("export_dtype", "float32")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", choices=("dcp-to-hf", "hf-to-dcp", "dcp-to-torch"))
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--flavor", default="", help="model flavor (dcp-to-hf; default: run config)")
    p.add_argument("--dtype", default="", choices=("", *DTYPES), help="exported weight dtype")
    p.add_argument("--all", action="store_true", help="dcp-to-torch: every key, not just weights")
    a = p.parse_args(argv)
    try:
        if a.mode == "hf-to-dcp":
            hf_to_dcp(a.src, a.dst, a.dtype or "float32")
        elif a.mode == "dcp-to-hf":
            dcp_to_hf(a.src, a.dst, a.flavor, a.dtype or run_default_dtype(a.src))
        else:
            dcp_to_torch(a.src, a.dst, a.dtype or run_default_dtype(a.src), a.all)
    except ValueError as e:
        print(f"convert_checkpoint: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
