"""The tiny training state the checkpoint tests save and load, and the trainer's moves on it.

Test modules reach these through the `tiny` fixture; tests/checkpoint/workers.py, run as a
script (this folder first on its sys.path), imports them directly.
"""

import random
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from titanlite.checkpoint import CheckpointManager, plan_load
from titanlite.checkpoint.staging import ReusingStager
from titanlite.config import Checkpoint
from titanlite.hf import hf_files


class Box:
    """Stands in for the data loader (a global position) and the train state."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def state_dict(self):
        return dict(self.__dict__)

    def load_state_dict(self, sd):
        self.__dict__.update(sd)


def build_manager(folder, /, shapes=(8, 16), **cfg) -> CheckpointManager:
    """A tiny model, AdamW and a warmup schedule, wrapped in a manager saving every step (unless
    `cfg` says otherwise) under `folder`. The model's weights are drawn from the global RNG."""
    model = nn.Sequential(nn.Linear(shapes[0], shapes[1]), nn.ReLU(), nn.Linear(shapes[1], 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    cfg = replace(Checkpoint(), **{"enable": True, "interval": 1, **cfg})
    loader, train_state = Box(pos=0), Box(step=0, tokens_seen=0)
    return CheckpointManager(cfg, folder, model, opt, sched, loader, train_state)


def train_steps(mgr, n, save=True):
    """n optimizer steps with random data; advances loader and train state like the trainer.
    With `save`, saves when due, complete on disk when it returns (the trainer's close() waits
    the same way)."""
    for _ in range(n):
        x = torch.randn(4, mgr.model[0].in_features)
        mgr.model(x).square().sum().backward()
        mgr.optimizer.step()
        mgr.optimizer.zero_grad()
        mgr.lr_scheduler.step()
        mgr.dataloader.pos += 4
        mgr.train_state.step += 1
        mgr.train_state.tokens_seen += 32
        if save and mgr.due(mgr.train_state.step):
            mgr.save(mgr.train_state.step)
    if save:
        mgr.wait()


def resume(mgr) -> int:
    """What train.py does at start-up: plan the load (before building, there), then load."""
    return mgr.load(plan_load(mgr.cfg, mgr.folder.parent))


def snapshot(mgr):
    """Everything a resume must restore, as comparable values."""
    opt_state = {
        (i, k): v.clone() for i, s in enumerate(mgr.optimizer.state.values()) for k, v in s.items()
    }
    return {
        "params": [p.detach().clone() for p in mgr.model.parameters()],
        "opt": opt_state,
        "sched": mgr.lr_scheduler.state_dict(),
        "lr": mgr.optimizer.param_groups[0]["lr"],
        "loader": mgr.dataloader.state_dict(),
        "train": mgr.train_state.state_dict(),
        "rng": (torch.get_rng_state(), random.getstate()),
    }


def assert_same(a, b):
    assert len(a["params"]) == len(b["params"])
    for x, y in zip(a["params"], b["params"], strict=True):
        assert torch.equal(x, y)
    assert a["opt"].keys() == b["opt"].keys() and a["opt"]
    for k in a["opt"]:
        assert torch.equal(a["opt"][k], b["opt"][k]), k
    assert a["sched"] == b["sched"] and a["lr"] == b["lr"]
    assert a["loader"] == b["loader"] and a["train"] == b["train"]
    assert torch.equal(a["rng"][0], b["rng"][0]) and a["rng"][1] == b["rng"][1]


def assert_resumes_as(folder, step: int, before: dict) -> None:
    """A fresh manager on `folder` resumes `step` holding the snapshot `before`, RNG aside (this
    process's generators moved on since; the RNG round trip is checked on its own)."""
    fresh = build_manager(folder)
    assert resume(fresh) == step
    after = snapshot(fresh)
    after["rng"] = before["rng"]
    assert_same(before, after)


def keep_staged(staged: list):
    """ReusingStager.stage, also keeping the Future of every state dict it staged in `staged`:
    kept alive, the buffers of a later save could not land at the addresses of an earlier one by
    chance."""
    stage = ReusingStager.stage

    def spy(self, state_dict, **kwargs):
        staged.append(stage(self, state_dict, **kwargs))
        return staged[-1]

    return spy


def hang_after_writing(flag: Path) -> None:
    """From now on, a save's data writes (local or fsspec: DCP's FileSystemWriter.write_data)
    finish, touch `flag` and hang before the .metadata is written: a process killed then has
    left a save midway."""
    orig = FileSystemWriter.write_data

    def slow_write(self, plan, planner):
        fut = orig(self, plan, planner)
        fut.wait()
        flag.touch()
        time.sleep(600)
        return fut

    FileSystemWriter.write_data = slow_write


def hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All weights of a Hugging Face folder, by HF name."""
    weights = {}
    for f in sorted(set(hf_files(folder).values())):
        weights.update(load_file(str(f)))
    return weights


@pytest.fixture
def tiny():
    """This file's helpers: test modules cannot import a conftest by name."""
    return SimpleNamespace(
        manager=build_manager, train=train_steps, resume=resume, snapshot=snapshot,
        assert_same=assert_same, assert_resumes_as=assert_resumes_as, keep_staged=keep_staged,
        hf_weights=hf_weights,
    )  # fmt: skip
