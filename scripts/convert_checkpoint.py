"""Convert titanlite checkpoints: DCP <-> Hugging Face (Llama 3, Qwen3), DCP -> one torch.save
file.

    python scripts/convert_checkpoint.py dcp-to-hf outputs/checkpoint/step-1000 hf_out [--flavor 8B]
    python scripts/convert_checkpoint.py hf-to-dcp hf_dir dcp_out
        (then train with --checkpoint.initial_load_path dcp_out; train.py also starts from
        hf_dir itself with --checkpoint.initial_load_in_hf)
    python scripts/convert_checkpoint.py dcp-to-torch outputs/checkpoint/step-1000 model.pt [--all]

Runs in one process without a process group (DCP resharding reads any saved layout). `--dtype`
(default: checkpoint.export_dtype of the run, else float32) applies to the exported weights.

Memory: one unit at a time, whatever the model size. dcp-to-hf loads the embedding, each block,
then norm + output, and writes each as one shard (model-0000K-of-0000N.safetensors) plus
model.safetensors.index.json; hf-to-dcp reads single-file or sharded exports one tensor at a time
and writes DCP lazily; dcp-to-torch (--all too) reserves the torch.save file's space, then fills
it tensor by tensor.

The HF format itself (names, RoPE row order, config.json) is `titanlite.hf`, driven by each
family's key map (its record's `hf`, chosen by config.json's model_type on import and by the run's
model.name on export), which the trainer's checkpoints use too.
"""

import argparse
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titanlite import precision
from titanlite.checkpoint.storage import is_remote, location, store
from titanlite.checkpoint.stream import (
    LazyTensor,
    save_lazily,
    single_process_quietly,
    torch_save_lazily,
)
from titanlite.config import Model
from titanlite.data.tokenizer import build_tokenizer
from titanlite.hf import INDEX, hf_files, hf_shape, read_hf_config, read_hf_tensor
from titanlite.hf_export import check_export_folder, write_export_files
from titanlite.models import family_of_hf, get_family, pad_vocab
from titanlite.progress import Progress  # noqa: E402

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

# Training's dtype table plus float16, for export only: the fast half type for inference on GPUs
# without bf16 (pre-Ampere), which many HF Llama checkpoints use.
DTYPES = {**precision.DTYPES, "float16": torch.float16}


class DcpCheckpoint:
    """A DCP checkpoint read a few keys at a time (full tensors, any saved sharding)."""

    def __init__(self, step_dir: Path):
        if not (step_dir / ".metadata").is_file():
            raise ValueError(f"{step_dir} is not a DCP checkpoint (no .metadata)")
        self.reader = store(step_dir).reader(step_dir)  # a folder, or s3:// / gs:// through fsspec
        self.metadata = self.reader.read_metadata()
        # Read once: each partial `dcp.load` below would otherwise parse it again, and a sharded
        # training checkpoint's metadata lists every chunk of every tensor.
        self.reader.read_metadata = lambda *args, **kwargs: self.metadata
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
    """The config.toml that train.py wrote for the run owning {dump}/{folder}/step-N, if any (none
    for a checkpoint in object storage: the run's config.toml is in its dump folder)."""
    if is_remote(step_dir):
        return step_dir.parent / "config.toml", {}
    path = step_dir.resolve().parents[1] / "config.toml"
    return path, tomllib.loads(path.read_text()) if path.is_file() else {}


def model_args_for(shapes: dict, flavor: str, step_dir: Path):
    """Shapes come from the weights; head counts, RoPE and eps from the flavor (given, or the
    one in the run's config.toml)."""
    cfg_path, cfg = run_config(step_dir)
    model_cfg = cfg.get("model", {})
    flavor = flavor or model_cfg.get("flavor")
    family = get_family(model_cfg.get("name", "llama3"))
    # A flavor of the family, or one named from it ("debugmodel_4L": 4 of its blocks).
    base = family.flavors.get(re.sub(r"_[1-9][0-9]*L$", "", flavor or ""))
    if base is None:
        raise ValueError(
            f"need --flavor (one of {list(family.flavors)}); got {flavor!r} and {cfg_path} "
            f"{'has no model.flavor' if cfg else 'does not exist'}"
        )
    vocab, dim = shapes["tok_embeddings.weight"]
    args = family.model_args(
        flavor,
        vocab_size=vocab,
        max_seq_len=int(cfg.get("training", {}).get("seq_len", base.max_seq_len)),
        use_scaled_rope=bool(model_cfg.get("use_scaled_rope", False)),
    )
    n_layers = len({k.split(".")[1] for k in shapes if k.startswith("layers.")})
    if (dim, n_layers) != (args.dim, args.n_layers):
        raise ValueError(
            f"{step_dir}: weights have dim {dim}, {n_layers} layers; flavor {flavor} has "
            f"dim {args.dim}, {args.n_layers} layers"
        )
    return args


def run_tokenizer(step_dir: Path, vocab_size: int):
    """(The run's tokenizer, its model config section) from its config.toml; (None, None) with a
    warning when there is none: the export then has weights and config.json only."""
    cfg_path, cfg = run_config(step_dir)
    if not cfg:
        print(
            f"convert_checkpoint: warning: {cfg_path} does not exist, so the run's tokenizer is "
            "unknown: no tokenizer files, no special ids in config.json",
            file=sys.stderr,
        )
        return None, None
    model_cfg = replace(Model(), **cfg.get("model", {}))
    tokenizer = build_tokenizer(model_cfg)
    if pad_vocab(tokenizer.n_words) != vocab_size:
        raise ValueError(f"the run's tokenizer ({cfg_path}) has {tokenizer.n_words} ids, the "
                         f"weights a vocabulary of {vocab_size}")  # fmt: skip
    return tokenizer, model_cfg


def dcp_to_hf(step_dir: Path, out: Path, flavor: str, dtype: str) -> None:
    check_export_folder(out)
    ckpt = DcpModel(step_dir)
    args = model_args_for(ckpt.shapes, flavor, step_dir)
    fmt = get_family(args.family_name).hf
    tokenizer, model_cfg = run_tokenizer(step_dir, args.vocab_size)
    parts = fmt.units(args)
    shards = [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    out.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    progress = Progress("exporting", len(shards), unit="shards", scale=1)
    for names, shard in zip(parts, shards, strict=True):
        hf = fmt.to_hf(ckpt.weights(names), args, DTYPES[dtype])
        save_file(hf, str(out / shard), {"format": "pt"})
        weight_map.update(dict.fromkeys(hf, shard))
        total += sum(t.nbytes for t in hf.values())
        del hf
        progress.add(1)
    progress.close()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    fmt.write_config(out, args, dtype)
    if tokenizer is not None:
        write_export_files(out, tokenizer, model_cfg.tokenizer_path, args.max_seq_len)


def hf_to_dcp(hf_dir: Path, out: Path, dtype: str) -> None:
    cfg = read_hf_config(hf_dir)
    files = hf_files(hf_dir)
    fmt = family_of_hf(cfg.get("model_type", "llama")).hf
    convert = fmt.from_hf_lazily(lambda name: read_hf_tensor(files, name), cfg, DTYPES[dtype])
    missing = [name for name, _ in convert.values() if name not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{hf_dir}: no {missing[0]}{more}")
    model = {
        ours: LazyTensor(hf_shape(files, name), DTYPES[dtype], make)
        for ours, (name, make) in convert.items()
    }
    save_lazily({"model": model}, out, "converting")
    # Loading it into titanlite needs a model with matching shapes: --model.flavor with this dim
    # and layer count, and a tokenizer whose padded size equals the vocab below.
    print(f"wrote {out}: vocab {cfg['vocab_size']}, dim {cfg['hidden_size']}, "
          f"{cfg['num_hidden_layers']} layers")  # fmt: skip


def dcp_to_torch(step_dir: Path, out: Path, dtype: str, everything: bool) -> None:
    if everything:  # optimizer, scheduler, loader, train state too, exactly as saved
        torch_save_lazily(whole_state_lazily(DcpCheckpoint(step_dir)), out, "converting")
        return
    ckpt = DcpModel(step_dir)
    to = DTYPES[dtype]

    def make(name: str):
        return lambda: ckpt.weights([name])[name].to(to)

    # Meta key names, like consolidated.00.pth
    model = {k: LazyTensor(tuple(size), to, make(k)) for k, size in ckpt.shapes.items()}
    torch_save_lazily(model, out, "converting")


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
    p.add_argument("src", help="a folder, or (dcp-to-*) an s3:// or gs:// step folder")
    p.add_argument("dst", type=Path)
    p.add_argument("--flavor", default="", help="model flavor (dcp-to-hf; default: run config)")
    p.add_argument("--dtype", default="", choices=("", *DTYPES), help="exported weight dtype")
    p.add_argument("--all", action="store_true", help="dcp-to-torch: every key, not just weights")
    a = p.parse_args(argv)
    try:
        src = location(a.src)
        if a.mode == "hf-to-dcp":
            hf_to_dcp(src, a.dst, a.dtype or "float32")
        elif a.mode == "dcp-to-hf":
            dcp_to_hf(src, a.dst, a.flavor, a.dtype or run_default_dtype(src))
        else:
            dcp_to_torch(src, a.dst, a.dtype or run_default_dtype(src), a.all)
    except ValueError as e:
        print(f"convert_checkpoint: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
