"""Checkpoint tests that need processes of their own (gloo ranks, or a child to SIGKILL):
`python workers.py NAME ARGS...`, launched by test_manager.py, test_layout.py, test_hf.py and
test_integrity.py.

Run as a script, this folder comes first on sys.path, so `conftest` is the one beside this file.
"""

import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from conftest import (
    build_manager,
    hang_after_writing,
    hf_weights,
    keep_staged,
    resume,
    train_steps,
)
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from titanlite.checkpoint import CheckpointError, CheckpointManager, plan_load
from titanlite.checkpoint.staging import ReusingStager
from titanlite.config import Checkpoint
from titanlite.distributed import destroy
from titanlite.models import get_family
from titanlite.models.decoder.model import Transformer
from titanlite.models.llama.args import ModelArgs

HF = get_family("llama3").hf


def slow_save(folder: str, checkpoint_folder: str = "checkpoint") -> None:
    """Save step 1, then hang in the save of step 2 once its data files are on disk (or in
    object storage at `checkpoint_folder`) and its .metadata is not, after touching `writing`:
    the test then kills this process."""
    mgr = build_manager(folder, folder=checkpoint_folder)
    train_steps(mgr, 1)
    hang_after_writing(Path(folder, "writing"))
    train_steps(mgr, 1)


def _same_step_on_every_rank(mgr) -> None:
    torch.manual_seed(100)  # the same batch on every rank
    train_steps(mgr, 1, save=False)


def fsdp(folder: str, mode: str) -> None:
    """FSDP over all ranks. "save": two async saves on their own gloo group, the second into the
    first's staging buffers, its weights changed right after save(). "load": resume the second.
    Rank 0 writes the full state to full_{mode}_{world}.pt."""
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    mgr = build_manager(folder, async_mode="async" if mode == "save" else "disabled")
    mesh = init_device_mesh("cpu", (world,))
    for m in (mgr.model[0], mgr.model[2], mgr.model):
        fully_shard(m, mesh=mesh)
    mgr.optimizer = torch.optim.AdamW(mgr.model.parameters(), lr=1e-2)  # over the sharded params
    mgr.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(mgr.optimizer, lambda s: 1.0)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if mode == "save":
        staged = []
        ReusingStager.stage = keep_staged(staged)
        _same_step_on_every_rank(mgr)
        mgr.save(1)
        _same_step_on_every_rank(mgr)  # while step 1 is written
        full = get_state_dict(mgr.model, mgr.optimizer, options=options)
        mgr.save(2)
        mgr.wait_for_staging()  # what the trainer does before its next optimizer step
        with torch.no_grad():  # while step 2 is written
            for p in mgr.model.parameters():
                p.add_(1.0)
        mgr.close()
        staged = [s.result()["model"] for s in staged]
        ptrs = [{k: t._local_tensor.data_ptr() for k, t in s.items()} for s in staged]
        assert len(ptrs) == 2 and ptrs[0] == ptrs[1] and len(ptrs[0]) == 4, ptrs
    else:
        assert resume(mgr) == 2
        full = get_state_dict(mgr.model, mgr.optimizer, options=options)
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(folder, f"full_{mode}_{world}.pt"))
    del mgr, mesh, full
    destroy()  # barrier first (rank 0 may still be saving), then free the groups before exit


def damaged(folder: str) -> None:
    """On 2 gloo ranks: async saves of steps 1 and 2 of an FSDP model, then rank 0 flips a bit in
    each rank's data file of step 2; each rank writes the error planning the load raised to
    error.rank{R}."""
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    mgr = build_manager(folder, async_mode="async")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in (mgr.model[0], mgr.model[2], mgr.model):
        fully_shard(m, mesh=mesh)
    mgr.optimizer = torch.optim.AdamW(mgr.model.parameters(), lr=1e-2)  # over the sharded params
    mgr.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(mgr.optimizer, lambda s: 1.0)
    for _ in range(2):
        _same_step_on_every_rank(mgr)
        mgr.save(mgr.train_state.step)
    mgr.close()
    step = Path(folder, "checkpoint", "step-2")
    if dist.get_rank() == 0:
        for name in ("__0_0.distcp", "__1_0.distcp"):
            data = bytearray((step / name).read_bytes())
            data[len(data) // 2] ^= 0x10
            (step / name).write_bytes(bytes(data))
    dist.barrier()
    try:
        plan_load(mgr.cfg, folder)
    except CheckpointError as e:
        Path(folder, f"error.rank{dist.get_rank()}").write_text(str(e))
    del mgr, mesh
    destroy()


# Heads split between FSDP shards: wk has one 32-row head, each of 2 ranks holds 16 of its rows.
SPLIT_HEADS = ModelArgs(
    dim=64, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=256, multiple_of=32, max_seq_len=32
)


def split_heads(root: str) -> None:
    """On 2 gloo ranks: load an HF folder into an FSDP model whose shards split a head, check
    it holds the weights exactly, save it back in HF format, check the files equal the source."""
    root = Path(root)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ref = Transformer(SPLIT_HEADS)
    ref.init_weights()
    src = root / "src"
    if dist.get_rank() == 0:
        src.mkdir()
        save_file(
            HF.to_hf(ref.state_dict(), SPLIT_HEADS, torch.float32), str(src / "model.safetensors")
        )
        HF.write_config(src, SPLIT_HEADS, "float32")
    dist.barrier()
    with torch.device("meta"):
        model = Transformer(SPLIT_HEADS)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu").init_buffers("cpu")
    cfg = replace(Checkpoint(), enable=True, initial_load_path=str(src), initial_load_in_hf=True,
                  last_save_model_only=True, last_save_in_hf=True)  # fmt: skip
    mgr = CheckpointManager(cfg, root / "run", model, None, None, None, None, last_step=1)
    assert mgr.load(plan_load(cfg, root / "run")) == 0
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    mgr.save(1)
    mgr.close()
    if dist.get_rank() == 0:
        for name, w in ref.state_dict().items():
            assert torch.equal(full[name], w), name
        saved, source = hf_weights(root / "run" / "checkpoint" / "step-1"), hf_weights(src)
        assert saved.keys() == source.keys()
        for name, w in source.items():
            assert torch.equal(saved[name], w), name
    destroy()


if __name__ == "__main__":
    workers = {"slow_save": slow_save, "fsdp": fsdp, "split_heads": split_heads, "damaged": damaged}
    workers[sys.argv[1]](*sys.argv[2:])
