"""Checksums of a checkpoint's files: recorded when it is saved, verified before it is loaded.

A save hashes each file as DCP writes it (`checksummed_writer`: the bytes are hashed on their
way to the file, never read back), and once every rank's files are on disk rank 0 gathers every
rank's sizes and digests into the step's COMPLETE marker (`"checksums": {"algorithm":
"xxh3_64", "files": {name: {"size", "digest"}}}`).
A load: every rank checks every world-th file of the list, so the checkpoint is read once in all
however many ranks load it; a missing or resized file is caught without reading it. A marker
without checksums (made by hand, a Hugging Face export, a seed checkpoint) loads unverified.

xxh3_64 (python-xxhash, which `datasets` already pulls in): among the fastest here and a 64-bit
digest (`scripts/benchmarks/bench_integrity.py`, 1 GiB in 16 MiB chunks, two runs on the 2-vCPU test
machine, GB/s: xxh3_64 10.1 / 9.1, hardware crc32c 6.2 / 10.4, google-crc32c 3.6 / 5.7, xxh64
4.2 / 4.0, zlib.crc32 2.0 / 2.1). Like them it releases the GIL, so an async save, which writes
and hashes in a background thread, does not stall the training thread. It guards against
accidents (bit flips, truncation, a lost shard), not tampering. Hashing the files after the save
instead reads them back, from disk where they did not stay in the page cache: a 1B save here took
34.6 s so against 21.8 s without checksums; hashed as written, it costs no more than the noise.
"""

import functools
import logging
import threading
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash

from titanlite.checkpoint.layout import MARKER, dist_on, read_marker
from titanlite.checkpoint.storage import store

logger = logging.getLogger(__name__)

ALGORITHM = "xxh3_64"
# Read at a time: memory stays flat however large a rank's files (about 12 GB each at 405B).
_CHUNK = 16 * 2**20


def file_digest(path: Path) -> str:
    """`path`: a Path, or a UPath (an object, read in the same chunks)."""
    digest = xxhash.xxh3_64()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with path.open("rb") as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


class _HashingStream:
    """A file opened for writing that hashes what is written to it: DCP only appends (it reads
    `tell()` for offsets, never seeks), so the digest is the file's."""

    def __init__(self, raw):
        self._raw, self.size, self.digest = raw, 0, xxhash.xxh3_64()
        self.error: OSError | None = None  # the write that failed: torch.save raises another

    def write(self, data) -> int:
        try:
            n = self._raw.write(data)  # a buffered binary file writes it all or raises
        except OSError as e:
            self.error = e
            raise
        self.digest.update(data)
        self.size += n
        return n

    def __getattr__(self, name):  # tell, flush, fileno (fsync), ...: the file's own
        return getattr(self._raw, name)


class _HashingFileSystem:
    """A DCP writer's file system (local or fsspec's), keeping the size and digest of every file
    written through it, by the name it ends up with (the .metadata is written as .metadata.tmp,
    then renamed)."""

    def __init__(self, inner):
        self._inner = inner
        self.written: dict[str, dict] = {}
        self.failures: list[str] = []

    def __getattr__(self, name):  # concat_path, mkdir, exists, ...: the inner file system's
        return getattr(self._inner, name)

    @contextmanager
    def create_stream(self, path, mode: str):
        with self._inner.create_stream(path, mode) as raw:
            if mode != "wb":
                yield raw
                return
            stream = _HashingStream(raw)
            try:
                yield stream
            except Exception as e:  # kept for _CheckedWriter: DCP's extra threads drop it
                e = stream.error or e  # a full disk's OSError, not torch.save's "unexpected pos"
                self.failures.append(f"{Path(path).name}: {type(e).__name__}: {e}")
                raise
        self.written[Path(path).name] = {"size": stream.size, "digest": stream.digest.hexdigest()}

    def rename(self, path, new_path) -> None:
        self._inner.rename(path, new_path)
        if Path(path).name in self.written:
            self.written[Path(new_path).name] = self.written.pop(Path(path).name)


@contextmanager
def _writer_threads_quiet(failures: list[str]):
    """A DCP writer thread that fails dies with its error, and Python prints a traceback per
    thread (a full disk fails all of them) beside the save's own one-line error. That error
    names `failures`, and a dead thread's items are missing, which fails the save: inside this
    context such a thread dies quietly, its error added to `failures` when none was recorded
    (it failed outside a file's writes). Any other thread's error is printed as before.

    DCP joins its writer threads only when the calling thread's own writes succeeded: on its
    error the others may still be writing into the step's folder, which the failed save then
    removes. So the context ends only once they are done."""
    before = set(threading.enumerate())
    previous = threading.excepthook

    def hook(args) -> None:
        name = args.thread.name if args.thread is not None else ""
        if "_write_files_from_queue" not in name:
            previous(args)
        elif not failures:
            failures.append(f"{args.exc_type.__name__}: {args.exc_value}")

    threading.excepthook = hook
    try:
        yield
    finally:
        for thread in set(threading.enumerate()) - before:
            if "_write_files_from_queue" in thread.name:
                thread.join()
        threading.excepthook = previous


class _CheckedWriter:
    """DCP's writer, whose save fails when any of this rank's items went unwritten. torch's
    writer collects no error from its threads but the first: a thread that fails (a full disk)
    just leaves its items out of the results, and DCP would write the .metadata and report the
    save done (checked on torch 2.13: 8 tensors saved, 2 in the metadata, the load a KeyError)."""

    def write_data(self, plan, planner):
        with _writer_threads_quiet(self.fs.failures):
            written = super().write_data(plan, planner)  # done: the threads were joined
        if len(written.value()) != len(plan.items):
            unwritten = len(plan.items) - len(written.value())
            raise OSError(
                f"{unwritten} of this rank's {len(plan.items)} checkpoint items were not written: "
                f"{'; '.join(self.fs.failures) or 'a writer thread failed'}"
            )
        return written


@functools.cache
def _checked(writer_class: type) -> type:
    """`writer_class` (DCP's local or fsspec writer) made a _CheckedWriter."""
    return type(f"Checked{writer_class.__name__}", (_CheckedWriter, writer_class), {})


# Files each rank writes at once. One writer thread (DCP's default) pickles, hashes and writes
# every tensor in turn and leaves the disk idle meanwhile: a 1B-flavor state (5.5 GiB, one
# process, a 2-core VM) saved at 0.40-0.47 GB/s with 1, 0.71-0.81 with 4 (__RANK_0..3.distcp).
WRITE_THREADS = 4


def checksummed_writer(folder: Path) -> dcp.FileSystemWriter:
    """DCP's writer for a save into `folder` (local or in object storage) that also hashes every
    file this rank writes, in WRITE_THREADS files at once."""
    where = store(folder)
    writer_class = _checked(where.writer_class())
    writer = writer_class(str(folder), thread_count=WRITE_THREADS, **where.writer_options(folder))
    writer.fs = _HashingFileSystem(writer.fs)
    return writer


def _gather(mine, group=None) -> list | None:
    """Every rank's `mine` on rank 0 of `group` (None on the others): what a rank sends is the
    size of its own part, whatever the world size."""
    if not dist_on():
        return [mine]
    everyone = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(mine, everyone, group=group, group_dst=0)
    return everyone


def record(writer: dcp.FileSystemWriter, group=None) -> dict | None:
    """Collective over `group` (None: the default one; nothing to join in a single process), run
    once the save through `writer` (a `checksummed_writer`) is complete on every rank. Rank 0
    returns the marker's "checksums", every rank's files; the other ranks None."""
    everyone = _gather(writer.fs.written, group)
    if everyone is None:
        return None
    files = {name: entry for part in everyone for name, entry in part.items()}
    return {"algorithm": ALGORITHM, "files": files}


def recorded(path: Path) -> dict | None:
    """The checksums a checkpoint's marker holds; None when it holds none we can check (a folder
    without a marker, one made by hand or by an export, another algorithm: then a warning)."""
    if not (path / MARKER).is_file():  # e.g. an initial_load_path written by a script
        return None
    checksums = read_marker(path).get("checksums")
    if checksums is not None and checksums.get("algorithm") != ALGORITHM:
        logger.warning(
            "%s: checksums in %s, which this version does not check: loading it unverified",
            path, checksums.get("algorithm"),
        )  # fmt: skip
        return None
    return checksums


def _damage(path: Path, entry: dict) -> str | None:
    """What is wrong with one file, or None: existence and size first (no read), then content."""
    if not path.is_file():
        return f"{path}: missing"
    size = path.stat().st_size  # an object's size: one HEAD request
    if size != entry["size"]:
        return f"{path}: {size} bytes, {entry['size']} when saved (truncated or overwritten)"
    try:
        digest = file_digest(path)
    except OSError as e:
        return f"{path}: unreadable ({e})"
    if digest != entry["digest"]:
        return (
            f"{path}: content changed since the save ({ALGORITHM} {digest}, "
            f"{entry['digest']} when saved)"
        )
    return None


def verify(folder: Path, checksums: dict) -> list[str]:
    """Collective over the default group: the damaged files of the checkpoint in `folder`, one
    "name: what is wrong" each, the same list on every rank (empty: every file verifies). Rank r
    checks the files r, r + world, r + 2 world, ... of the sorted list."""
    names = sorted(checksums["files"])
    me, world = (dist.get_rank(), dist.get_world_size()) if dist_on() else (0, 1)
    mine = [_damage(folder / n, checksums["files"][n]) for n in names[me::world]]
    everyone = _gather([d for d in mine if d])
    box = [sorted(sum(everyone, [])) if everyone is not None else None]
    if dist_on():
        dist.broadcast_object_list(box, group_src=0)
    return box[0]
