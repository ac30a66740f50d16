"""CheckpointManager: round trips, what each load restores, errors, async saves and their
staging, publishing off the training thread, RNG per rank, FSDP resharding. Single process unless
a test says otherwise (multi-process tests launch real gloo workers: workers.py)."""

import json
import pickle
import random
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_nested_equal, torchrun_script
from torch.distributed.checkpoint._state_dict_stager import StateDictStager

from titanlite.checkpoint import MARKER, scan_checkpoints
from titanlite.checkpoint.manager import _capture_rng, _restore_rng
from titanlite.checkpoint.staging import ReusingStager

WORKERS = Path(__file__).with_name("workers.py")


def test_round_trip_is_bitwise(tiny, tmp_path):
    mgr = tiny.manager(tmp_path)
    tiny.train(mgr, 3)  # saves steps 1, 2, 3
    before = tiny.snapshot(mgr)

    fresh = tiny.manager(tmp_path)
    torch.manual_seed(1234)
    random.seed(99)
    assert tiny.resume(fresh) == 3
    tiny.assert_same(before, tiny.snapshot(fresh))
    # and training continues identically
    torch.manual_seed(7)
    tiny.train(mgr, 1, save=False)
    torch.manual_seed(7)
    tiny.train(fresh, 1, save=False)
    for x, y in zip(mgr.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(x, y)


def test_save_time_is_recorded_and_checked_against_the_stop_grace(tiny, tmp_path, caplog):
    """Each checkpoint's marker holds how long its save took; a save slower than a stop signal
    leaves warns when it is made and again when a run resumes from it."""
    mgr = tiny.manager(tmp_path, stop_grace_seconds=1e-9)  # every save is slower
    tiny.train(mgr, 1)
    marker = json.loads((tmp_path / "checkpoint" / "step-1" / MARKER).read_text())
    assert marker["step"] == 1 and 0 < marker["save_seconds"] < 600
    slow = [r.getMessage() for r in caplog.records if "a stop signal" in r.getMessage()]
    assert len(slow) == 1 and slow[0].startswith("the save of step 1 took")
    caplog.clear()
    assert tiny.resume(tiny.manager(tmp_path, stop_grace_seconds=1e-9)) == 1
    assert [r for r in caplog.records if "the save of step-1 took" in r.getMessage()]
    caplog.clear()
    assert tiny.resume(tiny.manager(tmp_path, stop_grace_seconds=3600)) == 1
    assert not [r for r in caplog.records if "a stop signal" in r.getMessage()]


def test_fresh_start_and_exclude_from_loading(tiny, tmp_path):
    assert tiny.resume(tiny.manager(tmp_path)) == 0  # empty folder: fresh
    mgr = tiny.manager(tmp_path)
    tiny.train(mgr, 2)
    fresh = tiny.manager(tmp_path, exclude_from_loading=["optimizer", "dataloader", "train_state"])
    assert tiny.resume(fresh) == 0  # train state not restored: the caller starts at step 0
    assert not fresh.optimizer.state and fresh.dataloader.pos == 0
    assert fresh.lr_scheduler.state_dict() == mgr.lr_scheduler.state_dict()
    for x, y in zip(mgr.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(x, y)


def test_corrupt_file_unverified_still_gives_a_clear_error(tiny, tmp_path):
    # With checksums (the default) tests/checkpoint/test_integrity.py; here DCP's own failure.
    mgr = tiny.manager(tmp_path)
    tiny.train(mgr, 1)
    distcp = max(
        (tmp_path / "checkpoint" / "step-1").glob("*.distcp"), key=lambda p: p.stat().st_size
    )
    distcp.write_bytes(distcp.read_bytes()[: distcp.stat().st_size // 2])
    with pytest.raises(RuntimeError, match="failed to load checkpoint .*step-1"):
        tiny.resume(tiny.manager(tmp_path, verify_on_load=False))


def test_shape_mismatch_names_path_and_weight(tiny, tmp_path):
    mgr = tiny.manager(tmp_path)
    tiny.train(mgr, 1)
    other = tiny.manager(tmp_path, shapes=(8, 32))
    with pytest.raises(
        ValueError,
        match=r"step-1 does not match the model.*0\.weight: saved \(16, 8\), model \(32, 8\)",
    ):  # noqa: E501
        tiny.resume(other)


def test_seed_checkpoint_is_model_only_and_leaves_optimizer_alone(tiny, tmp_path):
    mgr = tiny.manager(tmp_path)
    mgr.save(0)  # what train.py does for create_seed_checkpoint: no optimizer step yet
    mgr.wait()
    assert not mgr.optimizer.state  # get_state_dict would have run a zero-grad step()
    assert (tmp_path / "checkpoint" / "step-0" / MARKER).is_file()
    fresh = tiny.manager(tmp_path)
    assert tiny.resume(fresh) == 0
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


def test_async_staging_reuses_its_buffers_and_keeps_call_time_values(tiny, tmp_path, monkeypatch):
    staged = []
    monkeypatch.setattr(ReusingStager, "stage", tiny.keep_staged(staged))
    mgr = tiny.manager(tmp_path, async_mode="async")
    tiny.train(mgr, 1)  # saves step 1: allocates the staging buffers
    tiny.train(mgr, 1, save=False)
    before = tiny.snapshot(mgr)
    mgr.save(2)
    mgr.wait_for_staging()  # what the trainer does before its next optimizer step
    with torch.no_grad():  # the next step updates weights and moments in place, mid-write
        for p in mgr.model.parameters():
            p.add_(1.0)
            mgr.optimizer.state[p]["exp_avg"].add_(1.0)
    mgr.wait()

    first, second = (tensor_ptrs(s.result()) for s in staged)
    assert len(first) == 16 and first == second  # 4 weights, 3 AdamW tensors each
    live = {p.data_ptr() for p in mgr.model.parameters()}
    assert not live & set(second.values())  # a copy, not the live tensors
    tiny.assert_resumes_as(tmp_path, 2, before)
    mgr.close()


def test_async_staging_runs_off_the_caller_until_waited_for(tiny, tmp_path, monkeypatch):
    """save() returns before the state is copied (the copy overlaps the next forward and
    backward); wait_for_staging() returns only once it is, and the copy holds save()'s values."""
    gate, copied_on = threading.Event(), []
    copy = StateDictStager.stage

    def gated_copy(self, state_dict, **kwargs):
        copied_on.append(threading.current_thread())
        assert gate.wait(120), "the copy was never released"
        return copy(self, state_dict, **kwargs)

    monkeypatch.setattr(StateDictStager, "stage", gated_copy)
    mgr = tiny.manager(tmp_path, async_mode="async")
    tiny.train(mgr, 1, save=False)
    before = tiny.snapshot(mgr)
    mgr.save(1)  # a copy on this thread would wait for the gate forever
    waiter = threading.Thread(target=mgr.wait_for_staging)
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive()  # held until the copy is done
    gate.set()
    waiter.join(120)
    assert not waiter.is_alive() and copied_on[0] is not threading.current_thread()
    with torch.no_grad():  # the optimizer step after the wait, while the write goes on
        for p in mgr.model.parameters():
            p.add_(1.0)
    mgr.wait()
    tiny.assert_resumes_as(tmp_path, 1, before)
    mgr.close()


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_publish_and_prune_run_off_the_training_thread(tiny, tmp_path, monkeypatch, mode):
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
    mgr = tiny.manager(tmp_path, async_mode=mode, keep_latest_k=1)
    tiny.train(mgr, 2)
    mgr.save(2)  # again: the complete step-2 is moved aside to step-2.old, then deleted
    mgr.wait()
    assert sorted(scan_checkpoints(tmp_path / "checkpoint")[0]) == [2]
    assert ("rmtree", "step-1", False) in calls and ("rmtree", "step-2.old", False) in calls
    on_loop = [c for c in calls if c[2] and not c[1].endswith(".tmp")]
    assert on_loop == [] and any(c[0] == "rename" for c in calls), calls
    mgr.close()


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


@pytest.mark.slow
def test_fsdp_async_saves_reuse_staging_and_reshard(tiny, tmp_path):
    # FSDP over 4 ranks, two async saves on their own gloo PG (the second into the first's
    # staging buffers, its weights changed right after save()); then load the second on 2 ranks
    # and in 1 process.
    torchrun_script(WORKERS, "fsdp", tmp_path, "save", nproc=4)
    torchrun_script(WORKERS, "fsdp", tmp_path, "load", nproc=2)
    saved = torch.load(tmp_path / "full_save_4.pt", weights_only=False)
    assert_nested_equal(saved, torch.load(tmp_path / "full_load_2.pt", weights_only=False))

    mgr = tiny.manager(tmp_path)  # one process, no process group, plain module
    assert tiny.resume(mgr) == 2 and mgr.dataloader.pos == 8
    model_sd, optim_sd = saved
    for name, p in mgr.model.named_parameters():
        assert torch.equal(p, model_sd[name]), name
        st = mgr.optimizer.state[p]
        assert torch.equal(st["exp_avg"], optim_sd["state"][name]["exp_avg"]), name
        assert torch.equal(st["exp_avg_sq"], optim_sd["state"][name]["exp_avg_sq"]), name


def test_finished_async_save_is_published_without_the_loop(tiny, tmp_path):
    """A completed async write becomes a complete checkpoint as soon as its data is on disk, not
    at the next save or exit: a crash in between must not lose it as a `.tmp` folder."""
    mgr = tiny.manager(tmp_path, async_mode="async")
    tiny.train(mgr, 1, save=False)
    mgr.save(1)
    deadline = time.monotonic() + 120
    while not scan_checkpoints(tmp_path / "checkpoint")[0] and time.monotonic() < deadline:
        time.sleep(0.01)  # nothing is called on the manager meanwhile
    assert list(scan_checkpoints(tmp_path / "checkpoint")[0]) == [1]
    mgr.close()


@pytest.mark.parametrize("first", [False, True])
def test_first_step_checkpoint_adds_step_1_to_the_schedule(tiny, tmp_path, first):
    mgr = tiny.manager(tmp_path, interval=10, enable_first_step_checkpoint=first)
    assert [s for s in range(1, 21) if mgr.due(s)] == ([1] if first else []) + [10, 20]
    mgr.close()
