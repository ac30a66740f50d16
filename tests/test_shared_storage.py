"""The shared-storage check on 2 real gloo ranks, each playing a node: a folder both see passes,
a folder each rank has its own copy of (two roots under one name) stops every rank, naming the
host, and a token cache of each node's own is a warning."""

import importlib.util
import logging
import os
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import config_error, free_port

from titanlite.checks import check_options, output_folders
from titanlite.config import ConfigError
from titanlite.config_parse import parse_args
from titanlite.shared_storage import check_shared_folders


def _rank(rank: int, port: int, root: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    own = os.path.join(root, f"node{rank}")  # the same option, a different folder per "node"
    os.makedirs(own, exist_ok=True)
    shared = os.path.join(root, "shared")
    logs = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())
    logging.getLogger("titanlite.shared_storage").addHandler(handler)
    outcome = {}
    for case, folders in {
        "shared": {"job.dump_folder": shared, "checkpoint.folder": shared},
        "own_dump": {"job.dump_folder": own, "checkpoint.folder": shared},
        "own_cache": {"job.dump_folder": shared, "the token cache": own},
    }.items():
        logs.clear()
        try:
            check_shared_folders(folders, required=("job.dump_folder", "checkpoint.folder"))
            outcome[case] = ("ok", list(logs))
        except ConfigError as e:
            outcome[case] = ("error", str(e))
    dist.barrier()  # rank 0 has removed its tokens
    outcome["left_behind"] = sorted(os.listdir(shared)) + sorted(os.listdir(own))
    results[rank] = outcome
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_nodes_two_roots(tmp_path):
    os.makedirs(tmp_path / "shared")
    results = mp.Manager().dict()
    mp.start_processes(
        _rank, args=(free_port(), str(tmp_path), results), nprocs=2, start_method="spawn"
    )
    host = socket.gethostname()
    for rank in (0, 1):
        r = results[rank]
        assert r["shared"] == ("ok", [])
        kind, message = r["own_dump"]
        assert kind == "error", r
        assert message.startswith(f"job.dump_folder {tmp_path / 'node'}")
        assert f"1 host(s) ({host}) do not see the file rank 0 (on {host})" in message
        assert "storage every node mounts" in message
        kind, logs = r["own_cache"]
        assert kind == "ok" and len(logs) == 1 and "the token cache" in logs[0], r
        assert r["left_behind"] == [], "rank 0 removes its token files"


def test_one_process_checks_nothing(tmp_path):
    check_shared_folders({"job.dump_folder": tmp_path / "absent"}, required=("job.dump_folder",))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--job.dump_folder", "gs://bucket/run"], "job.dump_folder 'gs://bucket/run' is a URL: "),
        (["--training.data_cache_dir", "s3://b/c"], "training.data_cache_dir 's3://b/c' is"),
        (["--checkpoint.folder", "azure://c/run"], "checkpoint.folder 'azure://c/run': azure:// "),
        (["--checkpoint.folder", "s3://b/run", "--checkpoint.last_save_in_hf",
          "--checkpoint.last_save_model_only", "--checkpoint.enable"], "dcp-to-hf"),
        (["--checkpoint.folder", "s3://b/run", "--checkpoint.create_seed_checkpoint"], "locally"),
        (["--checkpoint.initial_load_path", "s3://b/hf", "--checkpoint.initial_load_in_hf"],
         "download it first"),
    ],
)  # fmt: skip
def test_an_url_where_object_storage_is_not_read_is_refused(argv, message):
    """Taken as a path, `gs://bucket/run` would be a local folder `gs:/bucket/run`: a run that
    writes where no node after it can read. Checkpoints may be in object storage; the dump folder,
    the token cache and the options that write local folders may not."""
    assert message in config_error(argv)


def test_checkpoints_in_object_storage_pass_and_are_no_local_folder(monkeypatch):
    cfg = parse_args(["--checkpoint.enable", "--checkpoint.folder", "s3://b/run/checkpoint"])
    check_options(cfg)  # s3fs is a dev dependency
    assert "checkpoint.folder" not in output_folders(cfg)  # nothing made, nothing to share
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: None if n == "s3fs" else real(n))
    assert "need s3fs: pip install 'titanlite[s3]'" in config_error(
        ["--checkpoint.initial_load_path", "s3://b/run/checkpoint/step-10"]
    )
