"""Convert titanlite checkpoints: DCP <-> Hugging Face Llama, and DCP -> one torch.save file.

    python scripts/convert_checkpoint.py dcp-to-hf outputs/checkpoint/step-1000 hf_out [--flavor 8B]
    python scripts/convert_checkpoint.py hf-to-dcp hf_dir dcp_out
        (then train with --checkpoint.initial_load_path dcp_out)
    python scripts/convert_checkpoint.py dcp-to-torch outputs/checkpoint/step-1000 model.pt [--all]

Runs in one process without a process group (DCP resharding reads any saved layout). `--dtype`
(default: checkpoint.export_dtype of the run, else float32) applies to the exported weights.

RoPE: titanlite (like Meta) rotates interleaved pairs (2i, 2i+1) of each head; HF's rotate_half
pairs i with i + head_dim/2. The q/k projection rows are permuted so both give the same logits.
"""

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titanlite import precision
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


def load_dcp_model(step_dir: Path) -> dict[str, torch.Tensor]:
    """The model weights (full tensors) of a DCP checkpoint, read without the optimizer."""
    if not (step_dir / ".metadata").is_file():
        raise ValueError(f"{step_dir} is not a DCP checkpoint (no .metadata)")
    saved = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    model = {
        k[len("model.") :]: torch.empty(md.size, dtype=md.properties.dtype)
        for k, md in saved.items()
        if k.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    if not model:
        raise ValueError(f"{step_dir} holds no model weights (keys 'model.*')")
    state = {"model": model}
    dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    return state["model"]


def run_config(step_dir: Path) -> tuple[Path, dict]:
    """The config.toml that train.py wrote for the run owning {dump}/{folder}/step-N, if any."""
    path = step_dir.resolve().parents[1] / "config.toml"
    return path, tomllib.loads(path.read_text()) if path.is_file() else {}


def model_args_for(sd: dict, flavor: str, step_dir: Path) -> ModelArgs:
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
    vocab, dim = sd["tok_embeddings.weight"].shape
    n_layers = len({k.split(".")[1] for k in sd if k.startswith("layers.")})
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
    out = {hf: sd[ours] for ours, hf in GLOBAL_KEYS.items()}
    for i in range(args.n_layers):
        for ours, hf in LAYER_KEYS.items():
            w = sd[f"layers.{i}.{ours}"]
            if ours == "attention.wq.weight":
                w = to_hf_rope(w, args.n_heads)
            elif ours == "attention.wk.weight":
                w = to_hf_rope(w, args.num_kv_heads)
            out[f"model.layers.{i}.{hf}"] = w
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


def from_hf(hf: dict, cfg: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    n_heads = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_heads
    sd = {ours: hf[name] for ours, name in GLOBAL_KEYS.items()}
    for i in range(cfg["num_hidden_layers"]):
        for ours, name in LAYER_KEYS.items():
            w = hf[f"model.layers.{i}.{name}"]
            if ours == "attention.wq.weight":
                w = from_hf_rope(w, n_heads)
            elif ours == "attention.wk.weight":
                w = from_hf_rope(w, n_kv)
            sd[f"layers.{i}.{ours}"] = w
    return {k: v.to(dtype).contiguous() for k, v in sd.items()}


def dcp_to_hf(step_dir: Path, out: Path, flavor: str, dtype: str) -> None:
    sd = load_dcp_model(step_dir)
    args = model_args_for(sd, flavor, step_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(to_hf(sd, args, DTYPES[dtype]), str(out / "model.safetensors"), {"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(args, dtype), indent=2) + "\n")


def hf_to_dcp(hf_dir: Path, out: Path, dtype: str) -> None:
    cfg_file = hf_dir / "config.json"
    files = sorted(hf_dir.glob("*.safetensors"))
    if not cfg_file.is_file() or not files:
        raise ValueError(f"{hf_dir} needs config.json and *.safetensors (a HF Llama checkpoint)")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("tie_word_embeddings"):
        raise ValueError(
            f"{hf_dir}: tied embeddings are not supported (titanlite's output is untied)"
        )
    hf = {}
    for f in files:  # one file or shards; the union is the full state
        hf.update(load_file(str(f)))
    if "lm_head.weight" not in hf:
        raise ValueError(f"{hf_dir}: no lm_head.weight")
    sd = from_hf(hf, cfg, DTYPES[dtype])
    dcp.save({"model": sd}, checkpoint_id=str(out), no_dist=True)
    # Loading it into titanlite needs a model with matching shapes: --model.flavor with this dim
    # and layer count, and a tokenizer whose padded size equals the vocab below.
    print(f"wrote {out}: vocab {cfg['vocab_size']}, dim {cfg['hidden_size']}, "
          f"{cfg['num_hidden_layers']} layers")  # fmt: skip


def dcp_to_torch(step_dir: Path, out: Path, dtype: str, everything: bool) -> None:
    if everything:  # optimizer, scheduler, loader, train state too, exactly as saved
        dcp_to_torch_save(str(step_dir), str(out))
        return
    sd = {k: v.to(DTYPES[dtype]) for k, v in load_dcp_model(step_dir).items()}
    torch.save(sd, out)  # Meta key names, like consolidated.00.pth


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
