"""Muon's state through DCP checkpoints, end to end with train.py: an FSDP 2 run resumed from its
step-4 checkpoint is bitwise the uninterrupted run, and the same checkpoint resumed in one process
(resharded: every momentum buffer whole) continues it within 1e-5."""

import pytest
from conftest import TINY_TRAIN, read_jsonl, train_many

pytestmark = pytest.mark.slow  # launches processes

MUON = [
    *TINY_TRAIN, "--optimizer.name", "Muon", "--checkpoint.enable", "--checkpoint.interval", "4",
    "--training.steps", "8",
]  # fmt: skip
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]


def losses(folder, key="loss"):
    return {r["step"]: r[key] for r in read_jsonl(folder / "metrics.jsonl")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("muon_ckpt")
    step4 = lambda name: str(out / name / "checkpoint" / "step-4")  # noqa: E731
    train_many([
        [*MUON, *FSDP2, "--job.dump_folder", str(out / "ref")],
        {"copy": [step4("ref"), step4("resumed")]},
        [*MUON, *FSDP2, "--job.dump_folder", str(out / "resumed")],
        {"copy": [step4("ref"), step4("one")]},
    ], nproc=2)  # fmt: skip
    train_many([[*MUON, "--job.dump_folder", str(out / "one")]], nproc=1)
    return out


def test_muon_resume_is_bitwise(runs):
    for key in ("loss", "grad_norm", "lr"):
        ref, resumed = losses(runs / "ref", key), losses(runs / "resumed", key)
        assert sorted(resumed) == [5, 6, 7, 8], key
        assert {s: ref[s] for s in resumed} == resumed, key  # ==, not approx


def test_muon_checkpoint_reshards_to_one_process(runs):
    ref, one = losses(runs / "ref"), losses(runs / "one")
    assert sorted(one) == [5, 6, 7, 8]
    devs = [abs(one[s] / ref[s] - 1) for s in one]
    print(f"\nMuon FSDP 2 -> 1 process: relative loss deviation per step {devs}")
    assert max(devs) <= 1e-5, (one, ref)
