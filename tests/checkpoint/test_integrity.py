"""Checkpoint integrity: every save records its files' sizes and checksums in its marker, and a
damaged checkpoint (a flipped bit, a lost shard, a truncated file) or one of another model shape
is one clear error before anything is loaded, naming the file and the newest earlier checkpoint
that verifies. Single process, plus one 2-rank gloo run (workers.py)."""

import json
import re
import shutil
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import torchrun_script
from torch.distributed.checkpoint import filesystem

from titanlite.checkpoint import MARKER, CheckpointError, CheckpointManager, plan_load
from titanlite.checkpoint.integrity import ALGORITHM, file_digest
from titanlite.config import Checkpoint, ConfigError
from titanlite.models.decoder.model import Transformer
from titanlite.models.llama.args import ModelArgs

WORKERS = Path(__file__).with_name("workers.py")


def flip_bit(path: Path, at: float = 0.5) -> None:
    """One bit of `path` inverted, `at` of the way in: the size stays, the content does not."""
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_writer_thread_that_fails_fails_the_save(tiny, tmp_path, monkeypatch, mode):
    # DCP's writer threads after the first report no error (titanlite's writer counts the items
    # written): without the count this save would publish step 2 without that thread's items.
    mgr = tiny.manager(tmp_path, async_mode=mode)
    tiny.train(mgr, 1)
    mgr.wait()
    write_item = filesystem._write_item

    def full_disk_off_the_first_thread(*args, **kwargs):
        if threading.current_thread().name.endswith("(_write_files_from_queue)"):
            raise OSError(28, "No space left on device (injected)")
        return write_item(*args, **kwargs)

    monkeypatch.setattr(filesystem, "_write_item", full_disk_off_the_first_thread)
    with pytest.raises(CheckpointError, match=r"step 2 .*not written: __0_\d\.distcp: OSError.*"
                       "injected"):  # fmt: skip
        tiny.train(mgr, 1)
        mgr.wait()
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "checkpoint").iterdir()] == ["step-1"]
    assert tiny.resume(tiny.manager(tmp_path)) == 1


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_every_saved_file_is_in_the_marker(tiny, tmp_path, mode):
    mgr = tiny.manager(tmp_path, async_mode=mode)
    tiny.train(mgr, 1)
    mgr.close()
    step = tmp_path / "checkpoint" / "step-1"
    checksums = json.loads((step / MARKER).read_text())["checksums"]
    assert checksums["algorithm"] == ALGORITHM
    on_disk = {p.name for p in step.iterdir()} - {MARKER}
    assert set(checksums["files"]) == on_disk and ".metadata" in on_disk
    for name, entry in checksums["files"].items():
        assert entry == {"size": (step / name).stat().st_size, "digest": file_digest(step / name)}


def _distcp(step: Path) -> Path:
    """The rank's largest data file (each writer thread writes one)."""
    return max(step.glob("*.distcp"), key=lambda p: p.stat().st_size)


DAMAGE = {  # how a file is damaged -> what the error says about it
    "bit flip": (lambda p: flip_bit(p), "content changed since the save"),
    "missing shard": (Path.unlink, "missing"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-100]), r"\d+ bytes, \d+ when saved"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damage_names_the_file_and_the_newest_step_that_verifies(tiny, tmp_path, damage):
    tiny.train(tiny.manager(tmp_path), 3)  # saves steps 1, 2, 3
    ckpt = tmp_path / "checkpoint"
    harm, says = DAMAGE[damage]
    damaged = _distcp(ckpt / "step-3")
    harm(damaged)
    flip_bit(ckpt / "step-2" / ".metadata", at=0.9)  # the newest earlier step is damaged too
    # Raised while planning the load, before train.py builds the model: no weight is touched.
    with pytest.raises(CheckpointError) as err:
        plan_load(Checkpoint(enable=True), tmp_path)
    msg = str(err.value)
    assert re.search(rf"step-3 is damaged: {re.escape(str(damaged))}: {says}", msg), msg
    assert msg.endswith(
        "the newest earlier checkpoint that verifies is step 1: resume from it with "
        "--checkpoint.load_step 1"
    ), msg
    assert tiny.resume(tiny.manager(tmp_path, load_step=1)) == 1  # the way out works


def test_without_checksums_or_verification_loads_as_before(tiny, tmp_path, caplog):
    tiny.train(tiny.manager(tmp_path), 2)
    ckpt = tmp_path / "checkpoint"
    (ckpt / "step-2" / MARKER).write_text("")  # a marker made by hand
    assert tiny.resume(tiny.manager(tmp_path)) == 2
    flip_bit(ckpt / "step-1" / ".metadata", at=0.99)
    with pytest.raises(CheckpointError, match="step-1 is damaged.*no earlier checkpoint"):
        plan_load(Checkpoint(enable=True, load_step=1), tmp_path)
    plan_load(Checkpoint(enable=True, load_step=1, verify_on_load=False), tmp_path)
    weights = shutil.copytree(ckpt / "step-2", tmp_path / "weights")  # not a step: no marker
    (weights / MARKER).unlink()
    assert plan_load(Checkpoint(enable=True, initial_load_path=str(weights)), tmp_path / "b")


def test_damage_in_the_newest_names_an_unverifiable_earlier_step(tiny, tmp_path):
    tiny.train(tiny.manager(tmp_path), 2)
    ckpt = tmp_path / "checkpoint"
    (ckpt / "step-1" / MARKER).write_text("")
    flip_bit(_distcp(ckpt / "step-2"))
    with pytest.raises(CheckpointError, match="step 1, records no checksums to verify: resume"):
        plan_load(Checkpoint(enable=True), tmp_path)


def _llama(vocab: int, folder: Path) -> CheckpointManager:
    """A one-block Llama with `vocab` tokens, no optimizer: its saves hold the weights alone."""
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=vocab, multiple_of=32)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    cfg = replace(Checkpoint(), enable=True)
    return CheckpointManager(cfg, folder, model, None, None, None, None)


def test_another_vocabulary_is_refused_before_loading(tmp_path):
    saved = _llama(256, tmp_path)
    saved.save(1)
    saved.close()
    other = _llama(320, tmp_path)
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(
        ConfigError, match=r"tok_embeddings\.weight: saved \(256, 32\), model \(320"
    ):
        other.load(plan_load(other.cfg, tmp_path))
    assert all(torch.equal(v, before[k]) for k, v in other.model.state_dict().items())


@pytest.mark.slow
def test_two_ranks_record_their_own_files_and_agree_on_the_damage(tmp_path):
    # Async saves on 2 FSDP ranks (each hashes its own shard's file in its publisher thread);
    # then one bit flipped in each rank's file of step 2: both ranks raise the same error, each
    # file found by the rank that checked it.
    torchrun_script(WORKERS, "damaged", tmp_path, nproc=2)
    step = tmp_path / "checkpoint" / "step-2"
    files = json.loads((step / MARKER).read_text())["checksums"]["files"]
    assert set(files) == {p.name for p in step.iterdir()} - {MARKER}
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(files)  # both ranks' files are listed
    errors = [(tmp_path / f"error.rank{r}").read_text() for r in range(2)]
    assert errors[0] == errors[1], errors
    assert re.search(r"step-2/__0_0.distcp: content.*step-2/__1_0.distcp: content", errors[0])
    assert "verifies is step 1" in errors[0]
