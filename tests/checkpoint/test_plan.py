"""plan_load: which checkpoint a run resumes or starts from, and every path it cannot load
refused before the model is built, with the fix."""

import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titanlite.checkpoint import MARKER, CheckpointError, plan_load, scan_checkpoints
from titanlite.config import Checkpoint


def test_partial_folders_are_ignored_with_a_warning(tiny, tmp_path, caplog):
    mgr = tiny.manager(tmp_path)
    tiny.train(mgr, 2)
    ckpt = tmp_path / "checkpoint"
    # a crashed save leaves step-N.tmp; a folder that lost its marker is partial too
    (ckpt / "step-3.tmp").mkdir()
    (ckpt / "step-2" / MARKER).unlink()
    with caplog.at_level(logging.WARNING, logger="titanlite.checkpoint"):
        assert tiny.resume(tiny.manager(tmp_path)) == 1
    assert "step-3.tmp" in caplog.text and "step-2" in caplog.text


def test_initial_load_path_loads_weights_only(tiny, tmp_path):
    src = tiny.manager(tmp_path / "a")
    tiny.train(src, 2)
    step_dir = tmp_path / "a" / "checkpoint" / "step-2"
    mgr = tiny.manager(tmp_path / "b", initial_load_path=str(step_dir))
    assert tiny.resume(mgr) == 0
    assert not mgr.optimizer.state and mgr.dataloader.pos == 0 and mgr.train_state.step == 0
    for x, y in zip(src.model.parameters(), mgr.model.parameters(), strict=True):
        assert torch.equal(x, y)
    # the run's own folder wins over initial_load_path once it has a checkpoint
    tiny.train(mgr, 1)
    assert tiny.resume(tiny.manager(tmp_path / "b", initial_load_path=str(step_dir))) == 1

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
            tiny.resume(tiny.manager(tmp_path / "c", initial_load_path=str(bad)))


def test_initial_load_model_only_off_loads_the_whole_state(tiny, tmp_path):
    src = tiny.manager(tmp_path / "a")
    tiny.train(src, 2)
    step_dir = tmp_path / "a" / "checkpoint" / "step-2"
    mgr = tiny.manager(
        tmp_path / "b", initial_load_path=str(step_dir), initial_load_model_only=False
    )
    assert tiny.resume(mgr) == 2
    tiny.assert_same(tiny.snapshot(src), tiny.snapshot(mgr))


def test_last_save_model_only_is_an_export_not_a_resume_point(tiny, tmp_path, caplog):
    mgr = tiny.manager(
        tmp_path, last_save_model_only=True, export_dtype="bfloat16", keep_latest_k=1
    )
    mgr.last_step = 2
    tiny.train(mgr, 2)  # step 1: the whole state; step 2, the last: the weights in bfloat16
    export = tmp_path / "checkpoint" / "step-2"
    # keep_latest_k = 1 keeps the last full checkpoint next to the export.
    assert sorted(scan_checkpoints(tmp_path / "checkpoint")[0]) == [1, 2]
    saved = dcp.FileSystemReader(str(export)).read_metadata().state_dict_metadata
    assert {k.split(".")[0] for k in saved} == {"model", "meta"}
    assert {md.properties.dtype for k, md in saved.items() if k != "meta"} == {torch.bfloat16}

    with caplog.at_level(logging.WARNING, logger="titanlite.checkpoint"):
        assert tiny.resume(tiny.manager(tmp_path)) == 1
    assert f"Not resuming from {export}: it holds only the model weights" in caplog.text
    with pytest.raises(ValueError, match=r"load_step=2: .*step-2 holds only the model weights"):
        tiny.resume(tiny.manager(tmp_path, load_step=2))
    fresh = tiny.manager(tmp_path / "b", initial_load_path=str(export))  # a start, as it says
    assert tiny.resume(fresh) == 0
    for x, y in zip(mgr.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(x.bfloat16().float(), y)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_metadata_names_the_path(tiny, tmp_path, damage):
    tiny.train(tiny.manager(tmp_path), 1)  # saves step 1
    meta = tmp_path / "checkpoint" / "step-1" / ".metadata"
    data = meta.read_bytes()
    meta.write_bytes(
        {"truncate": data[: len(data) // 2], "garbage": b"\x00junk" * 50, "empty": b""}[damage]
    )
    with pytest.raises(CheckpointError) as err:
        plan_load(Checkpoint(enable=True), tmp_path)
    assert str(meta) in str(err.value) and "damaged" in str(err.value), err.value
