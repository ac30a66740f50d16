"""CheckpointManager: round trips, atomicity, pruning, errors, async, preemption; single process
unless a test says otherwise (multi-process tests launch real gloo workers)."""

import logging
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_nested_equal, torchrun_script
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.checkpoint.state_dict import StateDictOptions

from titanlite import checkpoint
from titanlite.checkpoint import (
    MARKER,
    CheckpointManager,
    _capture_rng,
    _read_metadata,
    _restore_rng,
    plan_load,
    scan_checkpoints,
)
from titanlite.config import Checkpoint

REPO = Path(__file__).resolve().parents[1]


class FakeLoader:
    """Stands in for the data loader: its state is a global position."""

    def __init__(self):
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, sd):
        self.pos = sd["pos"]


class FakeTrainState:
    def __init__(self):
        self.step, self.tokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, sd):
        self.step, self.tokens_seen = sd["step"], sd["tokens_seen"]


def resume(mgr) -> int:
    """What train.py does at start-up: plan the load (before building, there), then load."""
    return mgr.load(plan_load(mgr.cfg, mgr.folder.parent))


def make_setup(tmp_path, shapes=(8, 16), **cfg_overrides):
    """A tiny model, AdamW and a warmup schedule, wrapped in a manager writing under tmp_path."""
    model = nn.Sequential(nn.Linear(shapes[0], shapes[1]), nn.ReLU(), nn.Linear(shapes[1], 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    cfg = replace(Checkpoint(), enable=True, interval=1, **cfg_overrides)
    mgr = CheckpointManager(cfg, tmp_path, model, opt, sched, FakeLoader(), FakeTrainState())
    return mgr


def train_steps(mgr, n, save=True):
    """n optimizer steps with random data; advances loader and train state like the trainer.
    Saves are complete on disk when it returns (the trainer's close() waits the same way)."""
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
    mgr.wait()


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


def test_round_trip_is_bitwise(tmp_path):
    mgr = make_setup(tmp_path)
    train_steps(mgr, 3)  # saves steps 1, 2, 3
    before = snapshot(mgr)

    fresh = make_setup(tmp_path)
    torch.manual_seed(1234)
    random.seed(99)
    assert resume(fresh) == 3
    assert_same(before, snapshot(fresh))
    # and training continues identically
    torch.manual_seed(7)
    train_steps(mgr, 1, save=False)
    torch.manual_seed(7)
    train_steps(fresh, 1, save=False)
    for x, y in zip(mgr.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(x, y)


def test_checkpoint_with_param_groups_as_a_list_still_loads(tmp_path, monkeypatch):
    """Optimizer param groups are saved keyed by parameter name (pipeline stages hold different
    parameters); checkpoints from before, with a list of groups, load as they were saved."""
    monkeypatch.setattr(checkpoint, "_FLAT_OPTIMIZER", StateDictOptions())
    mgr = make_setup(tmp_path)
    train_steps(mgr, 2)
    monkeypatch.undo()
    assert "optimizer.param_groups.0.params" in _read_metadata(tmp_path / "checkpoint" / "step-2")
    fresh = make_setup(tmp_path)
    fresh.optimizer.param_groups[0]["betas"] = (0.0, 0.0)  # must come back from the checkpoint
    assert resume(fresh) == 2
    assert_same(snapshot(mgr), snapshot(fresh))
    assert fresh.optimizer.param_groups[0]["betas"] == mgr.optimizer.param_groups[0]["betas"]


def test_keep_latest_k_and_load_step(tmp_path):
    mgr = make_setup(tmp_path, keep_latest_k=2)
    train_steps(mgr, 4)
    complete, partial = scan_checkpoints(tmp_path / "checkpoint")
    assert sorted(complete) == [3, 4] and partial == []

    fresh = make_setup(tmp_path, load_step=3)
    assert resume(fresh) == 3
    assert fresh.train_state.step == 3 and fresh.dataloader.pos == 12

    with pytest.raises(ValueError, match=r"load_step=1: no complete checkpoint .*step-1.*\[3, 4\]"):
        resume(make_setup(tmp_path, load_step=1))


def test_fresh_start_and_exclude_from_loading(tmp_path):
    assert resume(make_setup(tmp_path)) == 0  # empty folder: fresh
    mgr = make_setup(tmp_path)
    train_steps(mgr, 2)
    fresh = make_setup(tmp_path, exclude_from_loading=["optimizer", "dataloader", "train_state"])
    assert resume(fresh) == 0  # train state not restored: the caller starts at step 0
    assert not fresh.optimizer.state and fresh.dataloader.pos == 0
    assert fresh.lr_scheduler.state_dict() == mgr.lr_scheduler.state_dict()
    for x, y in zip(mgr.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(x, y)


def test_partial_folders_are_ignored_with_a_warning(tmp_path, caplog):
    mgr = make_setup(tmp_path)
    train_steps(mgr, 2)
    ckpt = tmp_path / "checkpoint"
    # a crashed save leaves step-N.tmp; a folder that lost its marker is partial too
    (ckpt / "step-3.tmp").mkdir()
    (ckpt / "step-2" / MARKER).unlink()
    with caplog.at_level(logging.WARNING, logger="titanlite.checkpoint"):
        assert resume(make_setup(tmp_path)) == 1
    assert "step-3.tmp" in caplog.text and "step-2" in caplog.text


def test_corrupt_file_gives_a_clear_error(tmp_path):
    mgr = make_setup(tmp_path)
    train_steps(mgr, 1)
    (distcp,) = (tmp_path / "checkpoint" / "step-1").glob("*.distcp")
    distcp.write_bytes(distcp.read_bytes()[: distcp.stat().st_size // 2])
    with pytest.raises(RuntimeError, match="failed to load checkpoint .*step-1"):
        resume(make_setup(tmp_path))


def test_shape_mismatch_names_path_and_weight(tmp_path):
    mgr = make_setup(tmp_path)
    train_steps(mgr, 1)
    other = make_setup(tmp_path, shapes=(8, 32))
    with pytest.raises(
        ValueError,
        match=r"step-1 does not match the model.*0\.weight: saved \(16, 8\), model \(32, 8\)",
    ):  # noqa: E501
        resume(other)


def test_initial_load_path_loads_weights_only(tmp_path):
    src = make_setup(tmp_path / "a")
    train_steps(src, 2)
    step_dir = tmp_path / "a" / "checkpoint" / "step-2"
    mgr = make_setup(tmp_path / "b", initial_load_path=str(step_dir))
    assert resume(mgr) == 0
    assert not mgr.optimizer.state and mgr.dataloader.pos == 0 and mgr.train_state.step == 0
    for x, y in zip(src.model.parameters(), mgr.model.parameters(), strict=True):
        assert torch.equal(x, y)
    # the run's own folder wins over initial_load_path once it has a checkpoint
    train_steps(mgr, 1)
    assert resume(make_setup(tmp_path / "b", initial_load_path=str(step_dir))) == 1

    partial = tmp_path / "a" / "checkpoint" / "step-3.tmp"
    partial.mkdir()
    unmarked = tmp_path / "a" / "checkpoint" / "step-1"
    (unmarked / MARKER).unlink()
    for bad, msg in [
        (tmp_path / "nope", "does not exist"),
        (tmp_path / "a", "not a DCP"),
        (partial, "partial checkpoint"),
        (unmarked, "partial checkpoint"),
    ]:
        with pytest.raises(ValueError, match=f"initial_load_path: .*{msg}"):
            resume(make_setup(tmp_path / "c", initial_load_path=str(bad)))


def test_initial_load_model_only_off_loads_the_whole_state(tmp_path):
    src = make_setup(tmp_path / "a")
    train_steps(src, 2)
    step_dir = tmp_path / "a" / "checkpoint" / "step-2"
    mgr = make_setup(tmp_path / "b", initial_load_path=str(step_dir), initial_load_model_only=False)
    assert resume(mgr) == 2
    assert_same(snapshot(src), snapshot(mgr))


def test_last_save_model_only_is_an_export_not_a_resume_point(tmp_path, caplog):
    mgr = make_setup(tmp_path, last_save_model_only=True, export_dtype="bfloat16", keep_latest_k=1)
    mgr.last_step = 2
    train_steps(mgr, 2)  # step 1: the whole state; step 2, the last: the weights in bfloat16
    export = tmp_path / "checkpoint" / "step-2"
    # keep_latest_k = 1 keeps the last full checkpoint next to the export.
    assert sorted(scan_checkpoints(tmp_path / "checkpoint")[0]) == [1, 2]
    saved = dcp.FileSystemReader(str(export)).read_metadata().state_dict_metadata
    assert {k.split(".")[0] for k in saved} == {"model", "meta"}
    assert {md.properties.dtype for k, md in saved.items() if k != "meta"} == {torch.bfloat16}

    with caplog.at_level(logging.WARNING, logger="titanlite.checkpoint"):
        assert resume(make_setup(tmp_path)) == 1
    assert f"Not resuming from {export}: it holds only the model weights" in caplog.text
    with pytest.raises(ValueError, match=r"load_step=2: .*step-2 holds only the model weights"):
        resume(make_setup(tmp_path, load_step=2))
    fresh = make_setup(tmp_path / "b", initial_load_path=str(export))  # a start, as it says
    assert resume(fresh) == 0
    for x, y in zip(mgr.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(x.bfloat16().float(), y)


def test_seed_checkpoint_is_model_only_and_leaves_optimizer_alone(tmp_path):
    mgr = make_setup(tmp_path)
    mgr.save(0)  # what train.py does for create_seed_checkpoint: no optimizer step yet
    mgr.wait()
    assert not mgr.optimizer.state  # get_state_dict would have run a zero-grad step()
    assert (tmp_path / "checkpoint" / "step-0" / MARKER).is_file()
    fresh = make_setup(tmp_path)
    assert resume(fresh) == 0
    for x, y in zip(mgr.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(x, y)


def tensor_ptrs(state, path=""):
    """{path: data_ptr} of every tensor in a nested state dict (DTensors: their local shard)."""
    if isinstance(state, dict):
        return {
            k: v for key, sub in state.items() for k, v in tensor_ptrs(sub, f"{path}.{key}").items()
        }
    if torch.is_tensor(state):
        return {path: getattr(state, "_local_tensor", state).data_ptr()}
    return {}


def spy_staging(monkeypatch) -> list:
    """Every state dict that async saves staged, kept alive: fresh buffers for a later save
    could then not land at the addresses of an earlier one."""
    staged, stage = [], DefaultStager.stage

    def spy(self, state_dict, **kwargs):
        staged.append(stage(self, state_dict, **kwargs))
        return staged[-1]

    monkeypatch.setattr(DefaultStager, "stage", spy)
    return staged


def test_async_staging_reuses_its_buffers_and_keeps_call_time_values(tmp_path, monkeypatch):
    staged = spy_staging(monkeypatch)
    mgr = make_setup(tmp_path, async_mode="async")
    train_steps(mgr, 1)  # saves step 1: allocates the staging buffers
    train_steps(mgr, 1, save=False)
    before = snapshot(mgr)
    mgr.save(2)
    with torch.no_grad():  # the next step updates weights and moments in place, mid-write
        for p in mgr.model.parameters():
            p.add_(1.0)
            mgr.optimizer.state[p]["exp_avg"].add_(1.0)
    mgr.wait()

    first, second = (tensor_ptrs(s) for s in staged)
    assert len(first) == 16 and first == second  # 4 weights, 3 AdamW tensors each
    live = {p.data_ptr() for p in mgr.model.parameters()}
    assert not live & set(second.values())  # a copy, not the live tensors
    fresh = make_setup(tmp_path)
    assert resume(fresh) == 2
    after = snapshot(fresh)
    after["rng"] = before["rng"]  # the rng moved on in this process since; checked elsewhere
    assert_same(before, after)
    mgr.close()


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_publish_and_prune_run_off_the_training_thread(tmp_path, monkeypatch, mode):
    calls = []  # (what, folder name, on the training thread?)

    def spy(what, real):
        def record(path, *args, **kwargs):
            calls.append(
                (what, Path(path).name, threading.current_thread() is threading.main_thread())
            )
            return real(path, *args, **kwargs)

        return record

    monkeypatch.setattr(shutil, "rmtree", spy("rmtree", shutil.rmtree))
    monkeypatch.setattr(Path, "rename", spy("rename", Path.rename))
    mgr = make_setup(tmp_path, async_mode=mode, keep_latest_k=1)
    train_steps(mgr, 2)
    mgr.save(2)  # again: the complete step-2 is moved aside to step-2.old, then deleted
    mgr.wait()
    assert sorted(scan_checkpoints(tmp_path / "checkpoint")[0]) == [2]
    assert ("rmtree", "step-1", False) in calls and ("rmtree", "step-2.old", False) in calls
    on_loop = [c for c in calls if c[2] and not c[1].endswith(".tmp")]
    assert on_loop == [] and any(c[0] == "rename" for c in calls), calls
    mgr.close()


def test_prune_keeps_the_checkpoint_just_published(tmp_path):
    mgr = make_setup(tmp_path)
    train_steps(mgr, 4)
    mgr.close()
    # A rerun from step 1 saves step 2 again: the newest two by step are 3 and 4, but the new
    # step 2 is this run's only checkpoint after its start.
    rerun = make_setup(tmp_path, load_step=1, keep_latest_k=2)
    assert resume(rerun) == 1
    train_steps(rerun, 1)
    assert sorted(scan_checkpoints(tmp_path / "checkpoint")[0]) == [2, 3, 4]


@pytest.fixture
def fake_gpus(monkeypatch):
    """torch.cuda as one rank sees it: `see(n, current)` makes n GPUs visible, each with its own
    RNG state (filled with its index), and makes `current` this rank's device. Only for the RNG
    functions: DCP's writer would try to use the fake GPU."""
    gpus = SimpleNamespace(current=0, states={})

    def see(n, current):
        gpus.states = {i: torch.full((8,), i, dtype=torch.uint8) for i in range(n)}
        gpus.current = current

    def set_rng_state(state, device):
        gpus.states[device] = state.clone()

    gpus.see = see
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: gpus.current)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: gpus.states[device].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    return gpus


def test_rng_is_this_ranks_gpu_and_resumes_on_fewer_gpus(fake_gpus):
    fake_gpus.see(8, current=5)
    saved = pickle.dumps(_capture_rng())  # as the manager stores it
    assert torch.equal(pickle.loads(saved)["cuda"], fake_gpus.states[5])  # one state, not 8
    fake_gpus.see(1, current=0)  # the rerun gives each rank one visible GPU
    _restore_rng(pickle.loads(saved))
    assert torch.equal(fake_gpus.states[0], torch.full((8,), 5, dtype=torch.uint8))


@pytest.mark.parametrize(
    "saved_gpus, current, restored",
    [(8, 3, 3), (8, 0, 0), (1, 2, 0), (2, 5, None)],
    ids=["same-gpus", "fewer-gpus", "saved-seeing-one", "no-entry"],
)
def test_rng_from_checkpoints_with_every_gpus_state(
    fake_gpus, caplog, saved_gpus, current, restored
):
    """Older checkpoints hold every visible GPU's state per rank: the entry of this rank's
    device is restored, or the only one; with neither, the GPU keeps its state, with a warning."""
    fake_gpus.see(current + 1, current)
    state = _capture_rng()
    state["cuda"] = [torch.full((8,), 100 + i, dtype=torch.uint8) for i in range(saved_gpus)]
    with caplog.at_level(logging.WARNING, logger="titanlite.checkpoint"):
        _restore_rng(state)
    expected = current if restored is None else 100 + restored
    assert torch.equal(fake_gpus.states[current], torch.full((8,), expected, dtype=torch.uint8))
    assert ("none for cuda:5" in caplog.text) == (restored is None)


# Worker scripts run in fresh interpreters (torchrun or a killable child), so they carry their own
# tiny fixtures instead of importing this file.
_WORKER_COMMON = """
import sys, torch, torch.distributed as dist
from dataclasses import replace
from torch import nn
from titanlite.checkpoint import CheckpointManager, plan_load
from titanlite.config import Checkpoint

def resume(mgr): return mgr.load(plan_load(mgr.cfg, mgr.folder.parent))

class Box:
    def __init__(self, **kw): self.__dict__.update(kw)
    def state_dict(self): return dict(self.__dict__)
    def load_state_dict(self, sd): self.__dict__.update(sd)

def build(folder, **cfg):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    c = replace(Checkpoint(), enable=True, interval=1, **cfg)
    return CheckpointManager(c, folder, model, opt, sched, Box(pos=0), Box(step=0, tokens_seen=0))

def step(mgr, n):
    for i in range(n):
        torch.manual_seed(100 + i)  # same batch on every rank
        mgr.model(torch.randn(4, 8)).square().sum().backward()
        mgr.optimizer.step(); mgr.optimizer.zero_grad(); mgr.lr_scheduler.step()
        mgr.dataloader.pos += 4; mgr.train_state.step += 1
"""

_SLOW_SAVE = """
import time
from pathlib import Path
from torch.distributed.checkpoint.filesystem import FileSystemWriter
folder = sys.argv[1]
mgr = build(folder)
step(mgr, 1); mgr.save(1)
orig = FileSystemWriter.write_data
def slow_write(self, plan, planner):
    fut = orig(self, plan, planner)
    fut.wait()  # the data files are on disk, the .metadata is not: then the job is killed
    Path(folder, "writing").touch()
    time.sleep(600)
    return fut
FileSystemWriter.write_data = slow_write
step(mgr, 1); mgr.save(2)
"""


@pytest.mark.slow
def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path, caplog):
    script = tmp_path / "slow_save.py"
    script.write_text(_WORKER_COMMON + _SLOW_SAVE)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env)
    try:
        for _ in range(1200):
            if (tmp_path / "writing").exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert (tmp_path / "writing").exists(), f"child exited {proc.returncode} before writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert any((tmp_path / "checkpoint" / "step-2.tmp").glob("*.distcp"))
    mgr = make_setup(tmp_path)
    with caplog.at_level(logging.WARNING, logger="titanlite.checkpoint"):
        assert resume(mgr) == 1
    assert "partial checkpoint" in caplog.text and "step-2.tmp" in caplog.text
    assert mgr.dataloader.pos == 4


_FSDP = """
import os
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from titanlite.distributed import destroy
folder, mode = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
world = dist.get_world_size()
mgr = build(folder, async_mode="async" if mode == "save" else "disabled")
mesh = init_device_mesh("cpu", (world,))
for m in (mgr.model[0], mgr.model[2], mgr.model):
    fully_shard(m, mesh=mesh)
mgr.optimizer = torch.optim.AdamW(mgr.model.parameters(), lr=1e-2)  # over the sharded params
mgr.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(mgr.optimizer, lambda s: 1.0)
full_state = lambda: get_state_dict(
    mgr.model, mgr.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if mode == "save":
    staged, stage = [], DefaultStager.stage  # kept alive: fresh buffers would get new addresses
    DefaultStager.stage = lambda self, sd, **kw: staged.append(stage(self, sd, **kw)) or staged[-1]
    step(mgr, 1); mgr.save(1)
    step(mgr, 1)  # while step 1 is written
    full = full_state()
    mgr.save(2)
    with torch.no_grad():  # after save() returned, while step 2 is written
        for p in mgr.model.parameters():
            p.add_(1.0)
    mgr.close()
    ptrs = [{k: t._local_tensor.data_ptr() for k, t in s["model"].items()} for s in staged]
    assert len(ptrs) == 2 and ptrs[0] == ptrs[1] and len(ptrs[0]) == 4, ptrs
else:
    assert resume(mgr) == 2
    full = full_state()
if dist.get_rank() == 0:
    torch.save(full, os.path.join(folder, f"full_{mode}_{world}.pt"))
del mgr, mesh, full
destroy()  # barrier first (rank 0 may still be saving), then free the groups before exit
"""


@pytest.mark.slow
def test_fsdp_async_saves_reuse_staging_and_reshard(tmp_path):
    script = tmp_path / "fsdp.py"
    script.write_text(_WORKER_COMMON + _FSDP)
    # FSDP over 4 ranks, two async saves on their own gloo PG (the second into the first's
    # staging buffers, its weights changed right after save()); then load the second on 2 ranks
    # and in 1 process.
    torchrun_script(script, tmp_path, "save", nproc=4)
    torchrun_script(script, tmp_path, "load", nproc=2)
    saved = torch.load(tmp_path / "full_save_4.pt", weights_only=False)
    assert_nested_equal(saved, torch.load(tmp_path / "full_load_2.pt", weights_only=False))

    mgr = make_setup(tmp_path)  # one process, no process group, plain module
    assert resume(mgr) == 2 and mgr.dataloader.pos == 8
    model_sd, optim_sd = saved
    for name, p in mgr.model.named_parameters():
        assert torch.equal(p, model_sd[name]), name
        st = mgr.optimizer.state[p]
        assert torch.equal(st["exp_avg"], optim_sd["state"][name]["exp_avg"]), name
        assert torch.equal(st["exp_avg_sq"], optim_sd["state"][name]["exp_avg_sq"]), name
