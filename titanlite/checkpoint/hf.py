"""Hugging Face checkpoints straight into and out of a (sharded) model, through DCP.

Load: `dcp.load` with torch's HuggingFaceStorageReader, on a state dict keyed by HF names: every
rank reads from the safetensors files only the rows and columns of its own shards, whatever the
FSDP/TP layout. wq/wk are stored in HF's row order, a permutation within each head, and an FSDP
shard may split a head (405B on 512 ranks: 32 rows of a 128-row head), so their reads are widened
to the whole heads they touch, permuted, and cut back: a read costs at most two heads more.

Save: every rank writes its own shards (HuggingFaceStorageWriter, `sharded/`, one file per rank);
then the ranks consolidate them into whole-tensor files (the embedding, each block, norm +
output: convert_checkpoint's units), each rank building its share of the files one tensor at a
time, and put wq/wk of the files it built into HF's row order on disk, one tensor at a time. So
no rank ever holds more than its shards plus one full tensor, and nothing is gathered over the
network. Rank 0 writes config.json.
"""

import dataclasses
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from titanlite.checkpoint.layout import rank, world_size
from titanlite.checkpoint.stream import single_process_quietly
from titanlite.config import ConfigError
from titanlite.hf import (
    from_hf_rope,
    hf_files,
    hf_name,
    to_hf_rope_in_file,
    units,
    write_hf_config,
)
from titanlite.models.llama.args import ModelArgs
from titanlite.precision import DTYPES
from titanlite.torch_compat import consolidate_hf_safetensors


def hf_names(args: ModelArgs, names) -> dict[str, tuple[str, int | None]]:
    """{titanlite name: (HF name, RoPE head count or None)} for the model's weights."""
    return {ours: hf_name(ours, args.n_heads, args.num_kv_heads) for ours in names}


def check_heads(cfg: dict, args: ModelArgs, path: Path) -> None:
    """The shapes cannot tell how rows split into heads, and the RoPE order depends on it."""
    heads = (
        cfg["num_attention_heads"],
        cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
    )
    if heads != (args.n_heads, args.num_kv_heads):
        raise ConfigError(
            f"{path / 'config.json'} has {heads[0]} attention / {heads[1]} key-value heads, the "
            f"model {args.n_heads} / {args.num_kv_heads}: pick the matching --model.flavor"
        )


class _WholeHeadsLoadPlanner(DefaultLoadPlanner):
    """Reads the RoPE-permuted weights (`head_dims`: HF name -> rows per head) in whole heads,
    undoes the permutation, and keeps the rows this rank's shard asked for."""

    def __init__(self, head_dims: dict[str, int]):
        super().__init__()
        self.head_dims = head_dims
        self.widened: dict[ReadItem, tuple[ReadItem, int]] = {}  # read -> (asked, rows skipped)

    def create_local_plan(self):
        plan = super().create_local_plan()
        return dataclasses.replace(plan, items=[self._whole_heads(item) for item in plan.items])

    def _whole_heads(self, item: ReadItem) -> ReadItem:
        hd = self.head_dims.get(item.dest_index.fqn)
        if hd is None:
            return item
        first, rows = item.storage_offsets[0], item.lengths[0]
        lo, hi = first // hd * hd, -(-(first + rows) // hd) * hd
        wide = dataclasses.replace(
            item,
            storage_offsets=torch.Size([lo, *item.storage_offsets[1:]]),
            lengths=torch.Size([hi - lo, *item.lengths[1:]]),
        )
        self.widened[wide] = (item, first - lo)
        return wide

    def resolve_tensor(self, read_item: ReadItem):
        if read_item not in self.widened:
            return super().resolve_tensor(read_item)
        asked = super().resolve_tensor(self.widened[read_item][0])
        return torch.empty(read_item.lengths, dtype=asked.dtype)  # the reader fills it on CPU

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        if read_item not in self.widened:
            return super().commit_tensor(read_item, tensor)
        asked, skip = self.widened[read_item]
        heads = tensor.shape[0] // self.head_dims[read_item.dest_index.fqn]
        rows = from_hf_rope(tensor, heads)[skip : skip + asked.lengths[0]]
        super().resolve_tensor(asked).copy_(rows)


def load_hf(model, path: Path) -> None:
    """Load the HF folder `path` into `model` (any layout); shapes were checked by the caller."""
    args = model.args
    msd = get_model_state_dict(model)
    names = hf_names(args, msd)
    state = {names[ours][0]: t for ours, t in msd.items()}
    head_dims = {hf: args.head_dim for hf, heads in names.values() if heads is not None}
    with single_process_quietly():
        dcp.load(
            state,
            storage_reader=HuggingFaceStorageReader(str(path)),
            planner=_WholeHeadsLoadPlanner(head_dims),
        )
    set_model_state_dict(model, {ours: state[names[ours][0]] for ours in msd})


def save_hf(model, out: Path, dtype: str) -> None:
    """Write `model` (any layout) as a HF Llama folder `out` in `dtype`; called on every rank."""
    args = model.args
    msd = get_model_state_dict(model)
    names = hf_names(args, msd)
    state = {names[ours][0]: t.to(DTYPES[dtype]) for ours, t in msd.items()}
    sharded = out / "sharded"
    with single_process_quietly():
        dcp.save(
            state, storage_writer=HuggingFaceStorageWriter(str(sharded), save_distributed=True)
        )
    file_of = {names[ours][0]: i for i, unit in enumerate(units(args.n_layers), 1) for ours in unit}
    consolidate_hf_safetensors(str(sharded), str(out), file_of)
    # Every rank sees the index rank 0 wrote (the consolidation ends with a barrier).
    files = hf_files(out)
    me, world = rank(), world_size()
    mine = sorted(set(files.values()))[me::world]
    for hf, heads in names.values():
        if heads is not None and files[hf] in mine:
            to_hf_rope_in_file(files[hf], hf, heads)
    if world > 1:
        dist.barrier()
    if me == 0:
        write_hf_config(out, args, dtype)
        shutil.rmtree(sharded)
