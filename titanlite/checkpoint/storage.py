"""Where checkpoints live: a folder on a filesystem (a `pathlib.Path`) or a prefix in object
storage (`s3://bucket/...`, `gs://bucket/...`: a `UPath`, read and written through fsspec).

The layout is the same (layout.py); what differs is how a step becomes complete. On a filesystem
a save writes `step-N.tmp/` and publishing renames it to `step-N/`. An object store has no rename
(a copy of every object), so a save writes straight into `step-N/` and publishing writes its
COMPLETE marker last, once every rank's objects are stored. Everything that reads checkpoints
trusts only a step with its marker, and removing a step deletes the marker first: a save or a
deletion cut short leaves a partial step (ignored, reported), never a complete one with objects
missing. Credentials and the endpoint come from the store's usual environment (AWS_ENDPOINT_URL,
AWS_PROFILE, ...; GOOGLE_APPLICATION_CREDENTIALS), as for any fsspec client.
"""

import importlib.util
import re
import shutil
import uuid
from pathlib import Path

import torch.distributed.checkpoint as dcp

from titanlite.checkpoint.reader import DirectReader
from titanlite.config import ConfigError
from titanlite.torch_compat import fsspec_checkpoint_io

MARKER = "COMPLETE"
# The schemes a checkpoint folder may have, and the pip extra that brings each one's client.
EXTRAS = {"s3": ("s3", "s3fs"), "gs": ("gcs", "gcsfs")}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# Listings are never cached: other processes (the other ranks, a previous run) write the folder.
_OPTIONS = {"use_listings_cache": False}


def url_scheme(value: str) -> str | None:
    """The scheme of a URL ("s3" for s3://...), None for a path."""
    m = _URL.match(value or "")
    return m.group(1).lower() if m else None


def missing_client(scheme: str) -> str | None:
    """One line naming the extra to install when `scheme`'s fsspec client is not installed."""
    extra, module = EXTRAS[scheme]
    missing = [m for m in (module, "upath") if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return f"{scheme}:// checkpoints need {' and '.join(missing)}: pip install 'titanlite[{extra}]'"


def location(value: str):
    """A checkpoint folder given by the user: a Path, or a UPath for an object-store URL."""
    scheme = url_scheme(value)
    if scheme is None:
        return Path(value)
    if scheme not in EXTRAS:
        raise ConfigError(f"{value}: only {', '.join(f'{s}://' for s in EXTRAS)} URLs are read")
    problem = missing_client(scheme)
    if problem:
        raise ConfigError(problem)
    from upath import UPath

    return UPath(value, **_OPTIONS)


def object_store_unwritable(url: str) -> str | None:
    """Why an object can not be written and deleted under `url` (None: it can), in one line."""
    probe = location(url) / f".titanlite-probe-{uuid.uuid4().hex}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except Exception as e:  # botocore's and gcsfs's errors share no base class but Exception
        return (
            f"cannot write there ({type(e).__name__}: {e}); check the bucket's name, the "
            "credentials and, for a server other than AWS, AWS_ENDPOINT_URL"
        )
    return None


def checkpoint_folder(dump_folder, folder: str):
    """checkpoint.folder: a URL as it is, a path under the dump folder (unless absolute)."""
    return location(folder) if url_scheme(folder) else Path(dump_folder) / folder


def is_remote(path) -> bool:
    return not isinstance(path, Path)


class _Disk:
    """Steps on a filesystem: written as `step-N.tmp`, published by a rename."""

    @staticmethod
    def writer_class() -> type:
        return dcp.FileSystemWriter

    @staticmethod
    def writer_options(path) -> dict:
        return {}

    @staticmethod
    def save_path(folder: Path, step: int) -> Path:
        return folder / f"step-{step}.tmp"

    def begin_save(self, folder: Path, step: int) -> Path:
        """The empty folder a save of `step` writes into (a crashed save's leftovers gone)."""
        folder.mkdir(parents=True, exist_ok=True)
        tmp = self.save_path(folder, step)
        shutil.rmtree(tmp, ignore_errors=True)
        return tmp

    @staticmethod
    def publish(folder: Path, step: int, marker: str) -> Path:
        """Mark the written `step-N.tmp` complete and make it `step-N`. A complete `step-N`
        already there is moved aside first and deleted only after the new one took its place."""
        tmp, final = folder / f"step-{step}.tmp", folder / f"step-{step}"
        (tmp / MARKER).write_text(marker)
        old = folder / f"step-{step}.old"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        return final

    @staticmethod
    def remove(path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    @staticmethod
    def reader(path: Path) -> dcp.FileSystemReader:
        return DirectReader(str(path))

    @staticmethod
    def free_bytes(folder: Path) -> int | None:
        return shutil.disk_usage(folder).free


class _ObjectStore:
    """Steps in object storage: written in place, published by their marker, written last."""

    @staticmethod
    def writer_class() -> type:
        return fsspec_checkpoint_io()[0]

    @staticmethod
    def writer_options(path) -> dict:
        # An object is stored once its upload completes; DCP's fsync fallback would run a
        # os.sync() of the local disks after each file.
        return {"sync_files": False, **path.storage_options}

    @staticmethod
    def save_path(folder, step: int):
        return folder / f"step-{step}"

    def begin_save(self, folder, step: int):
        """`step-N/`, emptied: a crashed save's objects, or a complete step of that number
        (which stops being complete as its marker goes first)."""
        path = self.save_path(folder, step)
        self.remove(path)
        return path

    @staticmethod
    def publish(folder, step: int, marker: str):
        path = folder / f"step-{step}"
        (path / MARKER).write_text(marker)
        return path

    @staticmethod
    def remove(path) -> None:
        """Marker first: a deletion cut short leaves a partial step, not a damaged complete one."""
        fs = path.fs
        marker = (path / MARKER).path
        if fs.exists(marker):
            fs.rm_file(marker)
        if fs.exists(path.path):
            fs.rm(path.path, recursive=True)

    @staticmethod
    def reader(path) -> dcp.FileSystemReader:
        return fsspec_checkpoint_io()[1](str(path), **path.storage_options)

    @staticmethod
    def free_bytes(folder) -> int | None:
        return None  # a bucket has no free space to report


def store(path) -> _Disk | _ObjectStore:
    """How checkpoints under `path` (a folder or one of its steps) are written and removed."""
    return _ObjectStore() if is_remote(path) else _Disk()
