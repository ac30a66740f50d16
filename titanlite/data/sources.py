"""Where training text comes from: documents (str) in a deterministic order.

Three kinds of source:
- `python_stdlib` (the default): the Python standard library's own .py files. It is real,
  varied, human-written text (code, docstrings, comments) of about 10-12 MB that is present on
  every machine that can run titanlite, so the default config trains out of the box, offline, with
  no download. Excluded: site-packages (third-party, varies per machine), the test suites,
  idlelib, lib2to3, tkinter and turtledemo (large, repetitive or GUI boilerplate).
- local files (`dataset_path`): .json/.jsonl/.parquet/.txt/.arrow files (optionally compressed),
  globs or directories, several formats in one source read run by run in path order, with
  `datasets.load_dataset` (map-style, or streamed with `training.dataset_streaming`); the text
  lives in `dataset_text_column`. With `training.dataset_max_bad_rows` > 0 they are read row by
  row instead (`titanlite.data.diagnose`), so that a bad row is skipped, not its whole file.
- hub datasets (`c4`, `c4_test`, `fineweb`): streamed with `datasets` (`streaming=True`), never
  downloaded whole; the loader tokenizes them on the fly. A `dataset_path` wins over the name.
Prepared tokens (token stores, Megatron-LM .bin/.idx) are `titanlite.data.prepared`'s.
"""

import glob
import hashlib
import json
import logging
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import chain
from pathlib import Path
from typing import Any

from titanlite.config import ConfigError
from titanlite.data import prepared
from titanlite.data.diagnose import SkippedRows, check_files, data_error, read_rows, skip_bad

STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests"}
    | {"idlelib", "lib2to3", "tkinter", "turtledemo"}
)
# File extension -> datasets builder. Compressed variants are handled by datasets itself (.zst
# through the zstandard package, a dependency). .arrow: Arrow stream files, as datasets saves.
BUILDERS = {
    ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".arrow": "arrow"
}  # fmt: skip
COMPRESSION = (".gz", ".bz2", ".xz", ".zst")


@dataclass(frozen=True)
class HubDataset:
    path: str
    name: str | None
    split: str
    validation_split: str | None  # None: the dataset has no validation split
    data_files: list[str] | None = None  # lets tests point the hub code path at local files


HUB_DATASETS = {
    "c4": HubDataset("allenai/c4", "en", "train", "validation"),
    # c4_test: c4's validation split (~45 MB compressed), a small hub slice for quick runs; it
    # has nothing left to validate on, so validation needs validation.dataset_path.
    "c4_test": HubDataset("allenai/c4", "en", "validation", None),
    "fineweb": HubDataset("HuggingFaceFW/fineweb", "sample-10BT", "train", None),
}
DATASET_CHOICES = ("python_stdlib", "local", *HUB_DATASETS)


@dataclass(frozen=True)
class LocalFiles:
    """The files of a local source, for readers that read them without `datasets`
    (`titanlite.data.units`): (builder, files) runs in path order."""

    runs: list[tuple[str, list[Path]]]
    text_column: str
    max_bad_rows: int


@dataclass
class TextSource:
    """A named stream of documents. `fingerprint` identifies the exact content (file list, sizes,
    mtimes, column), so a token cache keyed by it is rebuilt whenever the data changes."""

    name: str
    fingerprint: str
    streaming: bool
    _documents: Callable[[], Iterator[str]] = field(repr=False)
    stream: "DocumentStream | None" = field(default=None, repr=False)  # set when streaming
    # Map-style with training.dataset_max_bad_rows: the bad rows of the last documents() pass.
    skipped: SkippedRows | None = field(default=None, repr=False)
    where: str = ""  # what the run reads, as its first log lines say it (`describe`)
    local: LocalFiles | None = field(default=None, repr=False)  # local files, not streamed

    def describe(self) -> str:
        return f"{self.name}: {self.where}" if self.where else self.name

    def documents(self) -> Iterator[str]:
        return self._documents()


@dataclass(frozen=True)
class DocumentStream:
    """A streamed source as a `datasets.IterableDataset`, which a loader can split between ranks
    (`datasets.distributed.split_dataset_by_node`) and stop and resume (`state_dict()`)."""

    open: Callable[[], Any] = field(repr=False)  # -> a fresh IterableDataset at its start
    text_column: str
    where: str  # names the source in errors
    files: tuple[Path, ...] = ()  # local files: a bad row is then named by file and line
    builder: str = ""
    max_bad_rows: int = 0  # > 0: `open` gives `read_rows`' rows, whose bad ones are skipped

    def texts(self, ds, skipped: SkippedRows | None = None) -> Iterator[str]:
        """The non-empty texts of `ds` (this stream or a share of it), one example at a time, so
        `ds.state_dict()` taken between two texts is the position right after the first. With
        max_bad_rows, bad rows are counted into `skipped` (None: left out uncounted)."""
        if self.max_bad_rows:
            return skip_bad(ds, skipped)
        return self._checked_texts(ds)

    def _checked_texts(self, ds) -> Iterator[str]:
        column, files = self.text_column, list(self.files)
        try:
            for example in ds:
                if column not in example:
                    raise _missing_column(self.where, column, list(example))
                text = example[column]
                if not isinstance(text, str):  # None: datasets' filling of a missing column
                    what = type(text).__name__ if text is not None else "null or missing"
                    raise _not_text(self.where, files, self.builder, column, what)
                if text:
                    yield text
        except ConfigError:
            raise
        except Exception as e:  # datasets' errors for malformed rows name no file or line
            if (error := data_error(files, self.builder, column)) is None:
                raise
            raise error from e


def _streamed(name: str, fingerprint: str, stream: DocumentStream, where: str) -> TextSource:
    def documents():
        return stream.texts(stream.open(), SkippedRows(stream.max_bad_rows))

    return TextSource(name, fingerprint, True, documents, stream, where=where)


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _file_stats(files: list[Path]) -> list:
    return [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def stdlib_files() -> tuple[Path, list[Path]]:
    """(stdlib root, its .py files sorted by relative path, exclusions applied)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    # Excluded folders are pruned, not walked and filtered: the interpreter's own site-packages
    # lies under the stdlib root and may hold tens of thousands of files (0.8 s of every
    # rank's start-up on a 2-core machine with 43k there).
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in STDLIB_EXCLUDED_DIRS]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def python_stdlib_source() -> TextSource:
    root, files = stdlib_files()
    if not files:
        raise ConfigError(f"no Python standard library sources found under {root}")

    def documents():
        for f in files:
            # errors="replace": a stray non-UTF-8 byte must not stop training on a default setup.
            text = f.read_text(encoding="utf-8", errors="replace")
            if text:  # empty __init__.py files would be bos+eos rows with nothing to learn
                yield text

    rel = [[s[0][len(str(root)) + 1 :], *s[1:]] for s in _file_stats(files)]
    fingerprint = _hash({"kind": "python_stdlib", "version": sys.version, "files": rel})
    where = f"{len(files)} .py files of the Python standard library under {root}"
    return TextSource("python_stdlib", fingerprint, False, documents, where=where)


def expand_paths(dataset_path: str) -> list[Path]:
    """Comma-separated files, globs or directories -> sorted data files. A file reached twice
    (listed twice, matched by two patterns, or through a symlink) is refused by name: overlapping
    globs list files twice by accident, and dropping the repeat would be a silent choice."""
    seen: dict[Path, str] = {}
    for pattern in (p.strip() for p in dataset_path.split(",")):
        if not pattern:
            continue
        pattern = os.path.expanduser(pattern)
        if os.path.isdir(pattern):
            matched = [str(p) for p in Path(pattern).rglob("*") if p.is_file() and _builder(p)]
        else:
            matched = glob.glob(pattern, recursive=True)
        if not matched:
            raise ConfigError(f"dataset_path {pattern!r} matches no data files")
        for m in sorted(matched):
            resolved = Path(m).resolve()
            if resolved in seen:
                raise ConfigError(
                    f"dataset_path {dataset_path!r} reaches {resolved} twice (as "
                    f"{seen[resolved]!r} and {m!r}); list each file once (a symlink counts as "
                    "its target)"
                )
            seen[resolved] = m
    return sorted(seen)


def _builder(path: Path) -> str | None:
    name = path.name
    for ext in COMPRESSION:
        name = name.removesuffix(ext)
    return BUILDERS.get(Path(name).suffix.lower())


def format_runs(files: list[Path]) -> list[tuple[str, list[Path]]]:
    """The files in their order, cut into runs of one format: datasets reads one format per
    call, so a source of several formats is read run by run, in path order."""
    builders = [_builder(f) for f in files]
    unknown = [str(f) for f, b in zip(files, builders, strict=True) if b is None]
    if unknown:
        raise ConfigError(
            f"cannot read {unknown[:3]}: supported extensions are {sorted(BUILDERS)} "
            f"(optionally compressed {COMPRESSION})"
        )
    runs: list[tuple[str, list[Path]]] = []
    for f, b in zip(files, builders, strict=True):
        if runs and runs[-1][0] == b:
            runs[-1][1].append(f)
        else:
            runs.append((b, [f]))
    return runs


def _missing_column(where: str, text_column: str, columns: list) -> ConfigError:
    return ConfigError(
        f"{where} has no column {text_column!r}; available columns: {columns}. "
        "Set training.dataset_text_column to one of them."
    )


def _not_text(
    where: str, files: list[Path], builder: str, text_column: str, what: str
) -> ConfigError:
    """A row without text (datasets fills it with None) or with a number for text: the bad row
    by file and line where the files show one, else a line naming the source."""
    no_text = f"{where}: a document's {text_column!r} is not text ({what})"
    return data_error(files, builder, text_column, no_text)


def _iter_texts(ds, text_column: str, where: str, files=(), builder="") -> Iterator[str]:
    """Texts of a map-style datasets Dataset, with a clear error for a wrong column, a column
    of numbers and a row without text (datasets fills it with None)."""
    if text_column not in ds.column_names:
        raise _missing_column(where, text_column, ds.column_names)
    feature = ds.features[text_column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):  # checked once
        raise _not_text(where, list(files), builder, text_column, f"a column of {feature}")
    for batch in ds.select_columns([text_column]).iter(batch_size=1024):
        texts = batch[text_column]
        if None in texts:
            raise _not_text(where, list(files), builder, text_column, "null or missing")
        yield from (t for t in texts if t)


def _load_dataset(path, name, data_files, split, streaming, **kwargs):
    import datasets  # heavy import: only when a datasets-backed source is used

    return datasets.load_dataset(
        path, name, data_files=data_files, split=split, streaming=streaming, **kwargs
    )


def _drop_parse_log(record: logging.LogRecord) -> bool:
    """datasets logs its half of a JSON parse failure ('... in row 60', counted from 0 within a
    block) above the error that names the file and line (`data_error`): leave that one line."""
    return not record.getMessage().startswith("Failed to load JSON from file")


def open_local(files: list[Path], builder: str, text_column: str, streaming: bool = False):
    """`datasets`' reading of local files (map-style: fast memory-mapped Arrow; or streaming,
    one stream shard per file), a failure named by file and line."""
    # addFilter keeps one copy of a filter, however often this runs.
    logging.getLogger("datasets.packaged_modules.json.json").addFilter(_drop_parse_log)
    # .txt: one document per file (datasets' default would make every LINE a document).
    kwargs = {"sample_by": "document"} if builder == "text" else {}
    try:
        return _load_dataset(builder, None, [str(f) for f in files], "train", streaming, **kwargs)
    except Exception as e:  # "An error occurred while generating the dataset": which row?
        if (error := data_error(files, builder, text_column)) is None:
            raise
        raise error from e


def local_source(
    dataset_path: str, text_column: str = "text", streaming: bool = False, max_bad_rows: int = 0
) -> TextSource:
    """Local files, of one format or several (read run by run, `format_runs`): through
    `datasets`, or row by row when up to `max_bad_rows` bad rows may be skipped
    (training.dataset_max_bad_rows)."""
    files = expand_paths(dataset_path)
    check_files(files)
    runs = format_runs(files)
    name, where = f"local-{files[0].stem}", f"dataset_path {dataset_path!r}"
    # Rows read here and by datasets agree for good data, but a store of each keeps its own key.
    tolerant = {"bad_rows": "skipped"} if max_bad_rows else {}
    kinds = sorted({b for b, _ in runs})
    kind = kinds[0] if len(kinds) == 1 else kinds  # one format: the key it always had
    fingerprint = _hash(
        {"kind": kind, "files": _file_stats(files), "column": text_column, **tolerant}
    )
    described = _files_line(files, "/".join(kinds))
    if streaming:
        if len(runs) > 1:
            raise ConfigError(
                f"{where} mixes formats {kinds}, and a stream reads one: stream one format per "
                "source, or drop --training.dataset_streaming"
            )
        builder = runs[0][0]
        opener = _row_stream if max_bad_rows else partial(open_local, streaming=True)
        stream = DocumentStream(
            partial(opener, files, builder, text_column), text_column, where, tuple(files),
            builder, max_bad_rows,
        )  # fmt: skip
        return _streamed(name, fingerprint, stream, described + ", streamed")

    def documents():
        if not max_bad_rows:
            return chain.from_iterable(
                _iter_texts(open_local(fs, b, text_column), text_column, where, fs, b)
                for b, fs in runs
            )
        source.skipped = SkippedRows(max_bad_rows)  # this pass's count, for the store's manifest
        rows = chain.from_iterable(_row_dicts(fs, b, text_column) for b, fs in runs)
        return skip_bad(rows, source.skipped)

    local = LocalFiles(runs, text_column, max_bad_rows)
    source = TextSource(name, fingerprint, False, documents, where=described, local=local)
    return source


def _files_line(files: list[Path], builder: str) -> str:
    shown = ", ".join(f.name for f in files[:3]) + (", ..." if len(files) > 3 else "")
    return f"{len(files)} {builder} file{'s' * (len(files) != 1)} ({shown}) under {files[0].parent}"


def _row_dicts(files: list[Path], builder: str, text_column: str) -> Iterator[dict]:
    for f in files:
        for text, problem in read_rows(Path(f), builder, text_column):
            yield {"text": text, "problem": problem}


def _row_stream(files: list[Path], builder: str, text_column: str):
    """`_row_dicts` as a datasets stream of one shard per file, as datasets' own builders make."""
    import datasets

    kwargs = {"files": [str(f) for f in files], "builder": builder, "text_column": text_column}
    return datasets.IterableDataset.from_generator(_row_dicts, gen_kwargs=kwargs)


def hub_source(dataset: str, text_column: str = "text", split: str = "train") -> TextSource:
    """A hub dataset, always streamed (c4 is ~300 GB; nothing is downloaded up front)."""
    spec = HUB_DATASETS[dataset]
    hub_split = spec.split if split == "train" else spec.validation_split
    if hub_split is None:
        raise ConfigError(
            f"dataset {dataset!r} has no validation split and a stream has no end to hold out "
            "from; set validation.dataset_path to local files"
        )
    return _hub_stream(dataset, spec, hub_split, text_column)


def named_hub_source(dataset: str, config: str, split: str, text_column: str) -> TextSource:
    """Any hub dataset by name (one of HUB_DATASETS, a repo id, or a local folder laid out as a
    hub repo), config and split, streamed: a [[training.mixture]] source's `dataset`."""
    spec = HUB_DATASETS.get(dataset) or HubDataset(dataset, None, "train", None)
    spec = replace(spec, name=config or spec.name, split=split or spec.split)
    return _hub_stream(dataset, spec, spec.split, text_column)


def _hub_stream(dataset: str, spec: HubDataset, hub_split: str, text_column: str) -> TextSource:
    def open_dataset():
        try:
            return _load_dataset(spec.path, spec.name, spec.data_files, hub_split, True)
        except ConnectionError as e:  # no network, or HF_HUB_OFFLINE with nothing cached
            raise ConfigError(
                f"dataset {dataset!r} streams {spec.path} from the Hugging Face Hub, "
                f"which this machine cannot reach ({e}); where there is network, save it as "
                "jsonl or parquet files, then train on them with --training.dataset local "
                "--training.dataset_path FILES"
            ) from e

    stream = DocumentStream(open_dataset, text_column, f"dataset {dataset!r} ({spec.path})")
    key = {"kind": "hub", "spec": repr(spec), "split": hub_split, "col": text_column}
    if os.path.isdir(spec.path):  # a local folder laid out as a hub repo: its files' stats too
        key["files"] = _file_stats(sorted(p for p in Path(spec.path).rglob("*") if p.is_file()))
    fingerprint = _hash(key)
    where = f"{spec.path} ({spec.name}, split {hub_split}) streamed from the Hugging Face Hub"
    # A repo id's or a folder's last part: the name is also the token cache folder's.
    return _streamed(f"{Path(dataset).name}-{hub_split}", fingerprint, stream, where)


def prepared_source(path: str) -> TextSource:
    """Prepared tokens (`titanlite.data.prepared`: token stores, Megatron .bin/.idx, several
    back to back) that the loader reads directly, so it gives no text."""
    fingerprint, where = prepared.describe(path)

    def documents():
        raise ConfigError(f"{path} holds prepared tokens, not text: train from it directly")

    name = "prepared-" + Path(prepared.parts(path)[0]).name
    return TextSource(name, fingerprint, False, documents, where=where)


def build_source(
    dataset: str,
    dataset_path: str = "",
    text_column: str = "text",
    split: str = "train",
    streaming: bool = False,
    max_bad_rows: int = 0,
) -> TextSource:
    """The source named by the training config. A `dataset_path` wins over any dataset name,
    the hub's included: the path is the more specific request (the shipped 8B/70B configs name
    c4, and adding --training.dataset_path is how a user trains on their own files), and the
    source's description (`describe`, the run's first log lines) says that the name is unused.
    `streaming` streams local files; hub datasets are always streamed. `max_bad_rows`: see
    `local_source`."""
    if dataset not in DATASET_CHOICES:
        raise ConfigError(f"unknown training.dataset {dataset!r}; choices: {list(DATASET_CHOICES)}")
    source = _build_source(dataset, dataset_path, text_column, split, streaming, max_bad_rows)
    if dataset_path and dataset in HUB_DATASETS:
        source.where += f" (training.dataset {dataset!r} unused: dataset_path wins)"
    return source


def _build_source(dataset, dataset_path, text_column, split, streaming, max_bad_rows):
    if prepared.is_prepared(dataset_path):  # tokens, read directly: win over the dataset name
        if streaming:
            raise ConfigError(
                f"{dataset_path} holds prepared tokens, read directly from disk at any position: "
                "drop --training.dataset_streaming (it streams text files)"
            )
        return prepared_source(dataset_path)
    if dataset_path:
        return local_source(dataset_path, text_column, streaming, max_bad_rows)
    if dataset in HUB_DATASETS:
        return hub_source(dataset, text_column, split)
    if dataset == "local":
        raise ConfigError("training.dataset 'local' needs training.dataset_path (files or globs)")
    return python_stdlib_source()
