"""Weights & Biases in the tests: the real package, offline, and a reader of what it wrote.

wandb ships no reader for an offline run's records any more (0.31), and in offline mode it writes
neither files/wandb-summary.json nor files/config.yaml: everything is in run-<id>.wandb, read
here. Its format: a 7-byte W&B header, then LevelDB's log format (32 KiB blocks of chunks, each
a 7-byte header - CRC, length, type - and a piece of one protobuf Record).
"""

import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

_BLOCK, _CHUNK_HEADER = 32768, 7
_FULL, _LAST = 1, 4  # chunk types that end a record (FIRST = 2 and MIDDLE = 3 continue one)


def wandb_offline_env(monkeypatch, home: Path) -> None:
    """Offline, quiet, and every wandb file outside the run's own folder under `home`. The
    user's own WANDB_* settings (project, run id, API key) are dropped so none leaks in."""
    for name in [n for n in os.environ if n.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # leave sys.stdout to pytest's capture
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")  # no crash reports sent anywhere
    # Where a request would go if anything tried one: a closed local port, never the internet.
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    for name in ("CONFIG_DIR", "CACHE_DIR", "DATA_DIR", "ARTIFACT_DIR"):
        monkeypatch.setenv(f"WANDB_{name}", str(home / name.lower()))


@dataclass
class OfflineRun:
    history: dict[int, dict]  # step -> the logged values (wandb's own _step etc. left out)
    config: dict
    exit_code: int | None
    name: str
    group: str


def read_offline_run(run_dir: Path, timeout_s: float = 60) -> OfflineRun:
    """The run's records, once its exit record is on disk: run.finish() returns before wandb's
    service has written them (the file can still hold only its header then)."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + timeout_s
    while True:
        data = next(run_dir.glob("*.wandb")).read_bytes()
        try:
            kinds = [record.WhichOneof("record_type") for record in _records(data)]
        except DecodeError:  # read while a record was half written
            kinds = []
        if "exit" in kinds:
            return _parse(data)
        if time.monotonic() > deadline:
            raise AssertionError(f"{run_dir}: no exit record after {timeout_s} s; records {kinds}")
        time.sleep(0.05)


def _parse(data: bytes) -> OfflineRun:
    run = OfflineRun(history={}, config={}, exit_code=None, name="", group="")
    for record in _records(data):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.name, run.group = record.run.display_name, record.run.run_group
            run.config.update(_items(record.run.config.update))
        elif kind == "config":
            run.config.update(_items(record.config.update))
        elif kind == "history":
            row = _items(record.history.item)
            run.history[record.history.step.num] = {
                k: v for k, v in row.items() if not k.startswith("_")
            }
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    run.config.pop("_wandb", None)
    return run


def _items(items) -> dict:
    return {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in items}


def _records(data: bytes):
    from wandb.proto import wandb_internal_pb2

    assert data[:4] == b":W&B", data[:8]
    pos, pieces = _CHUNK_HEADER, []  # the W&B header takes a chunk header's room in block 0
    while pos + _CHUNK_HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER:  # a block's tail too short for a chunk is zero padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK_HEADER])
        pieces.append(data[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length])
        pos += _CHUNK_HEADER + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            pieces = []
            yield record
