"""The object-store side of checkpoint folders (storage.py), on fsspec's in-memory file system:
a step is written in place and complete once its marker is there; removal deletes the marker
first. The same against a real S3 server, end to end: test_object_store.py."""

import uuid

import pytest
from upath import UPath

from titanlite.checkpoint.layout import publish, read_marker, scan_checkpoints
from titanlite.checkpoint.storage import MARKER, store


@pytest.fixture
def folder():
    path = UPath(f"memory://titanlite-{uuid.uuid4().hex}/checkpoint")
    yield path
    if path.fs.exists(path.parent.path):
        path.fs.rm(path.parent.path, recursive=True)


def _write_step(folder, step: int):
    path = store(folder).begin_save(folder, step)
    (path / "__0_0.distcp").write_bytes(b"data")
    return path


def test_a_step_in_object_storage_counts_once_its_marker_is_written(folder):
    path = _write_step(folder, 3)
    assert path == folder / "step-3"  # in place: there is no rename
    assert scan_checkpoints(folder) == ({}, [path])
    assert publish(folder, 3, {"note": 1}) == path
    assert scan_checkpoints(folder) == ({3: path}, [])
    assert read_marker(path) == {"step": 3, "note": 1}


def test_removal_and_a_new_save_of_a_step_delete_its_marker_first(folder, monkeypatch):
    _write_step(folder, 3)
    publish(folder, 3)
    deleted = []
    fs, rm_file = folder.fs, folder.fs.rm_file
    monkeypatch.setattr(fs, "rm_file", lambda p: (deleted.append(p), rm_file(p)))
    path = store(folder).begin_save(folder, 3)  # a save of step 3 again
    assert deleted[0].endswith(f"step-3/{MARKER}"), deleted
    assert not fs.find(path.path)  # nothing of the old step is left to mix with the new one
