"""The shared-storage check on 2 real gloo ranks, each playing a node: a folder both see passes,
a folder each rank has its own copy of (two roots under one name) stops every rank, naming the
host, and a token cache of each node's own is a warning."""

import logging
import os
import re
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import config_error, free_port

from titanlite.config import ConfigError
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
    "argv",
    [
        ["--checkpoint.folder", "s3://runs/a/checkpoint"],
        ["--job.dump_folder", "gs://bucket/run"],
        ["--checkpoint.initial_load_path", "s3://runs/a/checkpoint/step-10"],
    ],
)
def test_an_object_store_url_is_refused_not_taken_as_a_folder(argv):
    """Taken as a path, `s3://runs/a` would be a local folder `s3:/runs/a`: a run that saves
    where no node after it can read."""
    assert re.match(f"{argv[0][2:]} '{argv[1]}' is a URL: .*filesystem", config_error(argv))
