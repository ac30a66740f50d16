"""Checkpoints in object storage (checkpoint.folder = s3://...), against a real S3 server: moto's
server mode on 127.0.0.1, started here and reached by every process through AWS_ENDPOINT_URL, as
a user's runs reach theirs.

One reference run (FSDP 2, async saves every 2 steps, keep_latest_k 2) and the runs resumed from
its step 4 (FSDP 2, and one process: resharded) are launched once; the tests read them.
"""

import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import REPO, TINY_TRAIN, read_jsonl, train_many
from ranks import start_process

from titanlite.checkpoint import CheckpointError, plan_load, scan_checkpoints
from titanlite.checkpoint.storage import location
from titanlite.checks import check_output_folders
from titanlite.config import Checkpoint, ConfigError
from titanlite.config_parse import parse_args

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

BUCKET = "s3://titanlite-test"
WORKERS = Path(__file__).with_name("workers.py")
RUN = [*TINY_TRAIN, "--checkpoint.interval", "2", "--training.steps", "6"]


@pytest.fixture(scope="module")
def s3():
    """An S3 server on the loopback address, its endpoint and dummy credentials in this process's
    environment (the ranks' environment is copied from it) for the module's duration."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    location(BUCKET).fs.mkdir(BUCKET)
    yield BUCKET
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    server.stop()


def _job(tmp: Path, name: str, s3: str, *extra: str) -> list[str]:
    return [*RUN, "--job.dump_folder", str(tmp / name), "--checkpoint.folder", f"{s3}/{name}",
            *extra]  # fmt: skip


@pytest.fixture(scope="module")
def runs(s3, tmp_path_factory) -> Path:
    """ref: FSDP 2, async saves at 2, 4, 6 (keep_latest_k 2: step 2 goes); resumed: FSDP 2 from
    ref's step 4 (checkpoint.initial_load_path, the whole state; saving nothing); one: the same
    on one process."""
    out = tmp_path_factory.mktemp("objstore")
    start = ["--checkpoint.initial_load_path", f"{s3}/ref/step-4",
             "--no-checkpoint.initial_load_model_only"]  # fmt: skip
    keep = ["--checkpoint.enable", "--checkpoint.async_mode", "async",
            "--checkpoint.keep_latest_k", "2"]  # fmt: skip
    ref = _job(out, "ref", s3, *keep)
    train_many([ref, _job(out, "resumed", s3, *start)], nproc=2)
    train_many([_job(out, "one", s3, *start)], nproc=1)
    return out


def _metrics(folder: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_jsonl(folder / "metrics.jsonl")}


@pytest.mark.slow
def test_resume_from_object_storage_is_bitwise(runs):
    for key in ("loss", "grad_norm", "lr"):
        ref, resumed = _metrics(runs / "ref", key), _metrics(runs / "resumed", key)
        assert sorted(resumed) == [5, 6], key
        assert all(resumed[s] == ref[s] for s in resumed), (key, ref, resumed)


@pytest.mark.slow
def test_fsdp2_checkpoint_in_object_storage_loads_on_one_process(runs):
    """Resharded: the same weights and batch, only the fp32 reduction order differs (bounds as
    in test_resume.py's test_reshard_resume)."""
    ref, one = _metrics(runs / "ref", "loss"), _metrics(runs / "one", "loss")
    assert sorted(one) == [5, 6]
    devs = {s: abs(ref[s] - one[s]) / abs(ref[s]) for s in one}
    assert devs[5] < 5e-5 and max(devs.values()) < 1e-4, devs


@pytest.mark.slow
def test_retention_deletes_old_steps_and_keeps_only_complete_ones(runs, s3):
    folder = location(f"{s3}/ref")
    complete, partial = scan_checkpoints(folder)
    assert sorted(complete) == [4, 6] and partial == []
    assert not folder.fs.find(f"{folder.path}/step-2")  # every object, not just the marker
    names = {p.name for p in (folder / "step-6").iterdir()}
    assert {"COMPLETE", ".metadata", "__0_0.distcp", "__1_0.distcp"} <= names


@pytest.mark.slow
def test_damaged_object_is_named_and_an_earlier_step_offered(runs, s3):
    fs, name = location(s3).fs, f"{s3}/ref/step-6/__1_0.distcp"
    good = fs.cat_file(name)
    fs.pipe_file(name, good[:-1] + bytes([good[-1] ^ 1]))  # one bit, same size
    try:
        cfg = replace(Checkpoint(), enable=True, folder=f"{s3}/ref")
        with pytest.raises(CheckpointError) as err:
            plan_load(cfg, runs / "ref")
    finally:
        fs.pipe_file(name, good)
    assert "step-6/__1_0.distcp: content changed since the save" in str(err.value)
    assert "the newest earlier checkpoint that verifies is step 4" in str(err.value)


@pytest.mark.slow
def test_hf_export_from_object_storage_equals_the_local_export(runs, s3, tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    import convert_checkpoint

    step = location(f"{s3}/ref/step-4")
    step.fs.get(step.path, str(tmp_path / "local"), recursive=True)
    flavor = ["--flavor", TINY_TRAIN[TINY_TRAIN.index("--model.flavor") + 1]]
    for src, out in ((str(step), "from_s3"), (str(tmp_path / "local"), "from_disk")):
        assert convert_checkpoint.main(["dcp-to-hf", src, str(tmp_path / out), *flavor]) == 0
    exported = sorted(p.name for p in (tmp_path / "from_s3").iterdir())
    assert any(n.endswith(".safetensors") for n in exported)
    for n in exported:
        assert (tmp_path / "from_s3" / n).read_bytes() == (tmp_path / "from_disk" / n).read_bytes()


@pytest.mark.slow
def test_a_bucket_that_cannot_be_written_stops_the_run_at_start(s3):
    cfg = parse_args(["--checkpoint.enable", "--checkpoint.folder", f"{s3}/run/checkpoint"])
    check_output_folders(cfg)  # the bucket exists: a probe object written and deleted
    assert not location(s3).fs.find(f"{s3}/run")
    cfg.checkpoint.folder = "s3://no-such-bucket/run/checkpoint"
    with pytest.raises(ConfigError, match="checkpoint.folder s3://no-such-bucket/run/check.*"
                       "cannot write there .*bucket does not exist"):  # fmt: skip
        check_output_folders(cfg)


@pytest.mark.slow
def test_save_killed_midway_leaves_the_previous_step_the_one_resumed(s3, tiny, tmp_path, caplog):
    """SIGKILL while step 2's objects are being stored (workers.py slow_save, forked from the
    warm forkserver): its objects stay without a marker, and a restart resumes step 1, naming
    step 2 as partial."""
    folder = f"{s3}/killed"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = start_process(WORKERS, ["slow_save", tmp_path, folder], env, str(tmp_path / "log"))
    try:
        for _ in range(1200):
            if (tmp_path / "writing").exists() or not proc.is_alive():
                break
            time.sleep(0.05)
        assert (tmp_path / "writing").exists(), f"child exited {proc.exitcode} before writing"
    finally:
        proc.kill()
        proc.join()
    step2 = location(folder) / "step-2"
    assert any(step2.glob("*.distcp")) and not (step2 / "COMPLETE").exists()
    mgr = tiny.manager(tmp_path, folder=folder)
    with caplog.at_level(logging.WARNING, logger="titanlite.checkpoint"):
        assert tiny.resume(mgr) == 1
    assert "Ignoring partial checkpoint" in caplog.text and "killed/step-2" in caplog.text
    assert mgr.dataloader.pos == 4
