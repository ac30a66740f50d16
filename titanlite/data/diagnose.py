"""Bad rows of local data files, named down to the file and line, and skipped where the user
allows it (training.dataset_max_bad_rows).

`datasets` reports a malformed JSON line, a file it cannot decode or a broken parquet footer as
"An error occurred while generating the dataset", and fills a missing text column with None,
which would silently drop the document. Reading strictly (the default), `datasets` reads the
files and the rows are read here only after something went wrong (or a None text was met), so a
good corpus of any size pays nothing for them; `data_error` then names the first bad row.
Reading tolerantly, every row is read here (`read_rows`, plain Python: slower than `datasets`' C
readers): `skip_bad` leaves a bad row out and counts it (`SkippedRows`) instead of losing the
file, and a file that cannot be read at all still stops the run (`BadFile`).
"""

import json
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from titanlite.config import ConfigError

MAX_BAD_ROWS = "training.dataset_max_bad_rows"
# A row of a data file: (text, None), or (None, "file:line: what is wrong with it").
Row = tuple[str | None, str | None]


class BadFile(ConfigError):
    """A data file that gives no row at all; the message names it and says what to do."""


def check_files(files: list[Path]) -> None:
    """An empty data file is a mistake upstream (a failed export or copy), not an empty shard,
    and an unreadable one would fail deep inside `datasets`. Metadata only: a corpus of a
    million small files is not read here, on every rank."""
    empty = [f for f in files if f.stat().st_size == 0]
    unreadable = [f for f in files if not os.access(f, os.R_OK)]
    for bad, what in ((empty, "is empty"), (unreadable, "cannot be read by this user")):
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise ConfigError(f"data file {bad[0]} {what}{more}: fix or remove it from the path")


def read_rows(path: Path, builder: str, text_column: str) -> Iterator[Row]:
    """The rows of one file in order; raises `BadFile` where the file itself is unusable."""
    return _READERS[builder](path, text_column)


def first_problem(files: list[Path], builder: str, text_column: str) -> str | None:
    """The first bad row or file, with its fix, or None when none is found."""
    for f in files:
        try:
            problem = next((p for _, p in read_rows(f, builder, text_column) if p), None)
        except BadFile as e:
            return str(e)
        if problem:
            return problem + _FIX[builder]
    return None


def data_error(
    files: list[Path], builder: str, text_column: str, fallback: str | None = None
) -> ConfigError | None:
    """The one-line error for bad data: the first problem found, else `fallback` (None: no
    error; the caller re-raises what it met, since the files look right)."""
    problem = first_problem(files, builder, text_column) if files else None
    if problem:
        return ConfigError(problem)
    return ConfigError(fallback) if fallback else None


def bad_row_error(problem: str, builder: str) -> ConfigError:
    """A bad row met reading strictly: named, with its fix."""
    return ConfigError(problem + _FIX.get(builder, ""))


_FIX = {
    "json": (
        "; fix or remove that row (JSON lines: one object per line, text in the text column), "
        f"or let {MAX_BAD_ROWS} skip such rows"
    ),
    "parquet": f"; rewrite that file without the row, or let {MAX_BAD_ROWS} skip such rows",
    "arrow": f"; rewrite that file without the row, or let {MAX_BAD_ROWS} skip such rows",
}


@dataclass
class SkippedRows:
    """The bad rows left out so far and the last one; one more than `limit` stops the run.
    Rows are read in the same order on every rank that reads them, so the count is too."""

    limit: int
    count: int = 0
    last: str = ""

    def add(self, problem: str) -> None:
        self.count, self.last = self.count + 1, problem
        if self.count > self.limit:
            raise ConfigError(
                f"{problem}: bad row {self.count}, more than {MAX_BAD_ROWS} = {self.limit} "
                "allows; fix or remove the bad rows, or raise the limit"
            )


def skip_bad(rows: Iterable[dict], skipped: SkippedRows | None) -> Iterator[str]:
    """The non-empty texts of `rows` ({"text", "problem"}), bad ones counted into `skipped`
    (None: left out uncounted, as on a later pass over rows counted before)."""
    for row in rows:
        if row["problem"]:
            if skipped is not None:
                skipped.add(row["problem"])
        elif row["text"]:
            yield row["text"]


def check_skipped(meta: dict, limit: int, where: str) -> int:
    """The bad rows a token store was built without (its manifest), refused beyond `limit`."""
    count = meta.get("skipped_rows", 0)
    if count > limit:
        raise ConfigError(
            f"{where} was tokenized leaving out {count} bad rows (the last: "
            f"{meta['last_skipped_row']}), more than {MAX_BAD_ROWS} = {limit} allows; fix the "
            "data and prepare it again, or raise the limit"
        )
    return count


def _open_text(path: Path):
    import fsspec  # datasets' dependency: the same decompressors datasets uses

    return fsspec.open(str(path), "rt", compression="infer", encoding="utf-8")


@contextmanager
def _reading(path: Path):
    try:
        yield
    except UnicodeDecodeError as e:
        raise BadFile(f"{path}: not UTF-8 text ({e}); re-encode it as UTF-8 or remove it") from e
    except (OSError, EOFError) as e:  # unreadable, or a truncated or corrupt compressed file
        raise BadFile(f"{path}: cannot be read ({e}); replace it or remove it") from e


def _json_rows(path: Path, text_column: str) -> Iterator[Row]:
    with _reading(path), _open_text(path) as f:
        rows = 0
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rows += 1
            try:
                row, error = json.loads(line), None
            except ValueError as e:
                row, error = None, f"{path}:{n}: not valid JSON ({e})"
            # A first row that is no object may be the start of one JSON document (a list).
            if rows == 1 and not isinstance(row, dict) and (doc := _document(path)) is not None:
                items = doc if isinstance(doc, list) else [doc]
                yield from (
                    json_row(r, text_column, f"{path}: item {i}") for i, r in enumerate(items)
                )
                return
            yield (None, error) if error else json_row(row, text_column, f"{path}:{n}")
        if not rows:  # e.g. a compressed empty file: not zero bytes on disk
            raise BadFile(f"{path}: no rows, only blank lines; remove it")


def _document(path: Path):
    """The whole file as one JSON value, or None if it is not one."""
    try:
        with _open_text(path) as f:
            return json.load(f)
    except ValueError:
        return None


_JSON_KINDS = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}


def json_row(row, text_column: str, where: str) -> Row:
    if not isinstance(row, dict):
        return None, f"{where}: a JSON {_JSON_KINDS.get(type(row), 'null')}, not an object"
    return text_row(row.get(text_column), text_column, where, f"keys: {sorted(row)[:8]}")


def text_row(text, text_column: str, where: str, missing: str) -> Row:
    if text is None:
        return None, f"{where}: no {text_column!r} ({missing})"
    if not isinstance(text, str):
        return None, f"{where}: {text_column!r} is {text!r:.40} ({type(text).__name__}), not text"
    return text, None


def _parquet_rows(path: Path, text_column: str) -> Iterator[Row]:
    import pyarrow.parquet as pq  # datasets' dependency

    try:  # pyarrow raises ArrowInvalid, OSError, KeyError... for bad files
        batches = pq.ParquetFile(path).iter_batches(columns=[text_column])
        texts = (t for batch in batches for t in batch.column(0).to_pylist())
        for i, text in enumerate(texts):
            yield text_row(text, text_column, f"{path}: row {i}", "null")
    except Exception as e:
        raise BadFile(
            f"{path}: not a readable parquet file with column {text_column!r} ({e}); rewrite "
            "or remove that file"
        ) from e


def _text_rows(path: Path, text_column: str) -> Iterator[Row]:
    with _reading(path), _open_text(path) as f:  # one document per file
        yield f.read(), None


def _arrow_rows(path: Path, text_column: str) -> Iterator[Row]:
    """An Arrow stream file, as datasets writes one (`Dataset.save_to_disk`'s data files)."""
    import pyarrow as pa  # datasets' dependency

    try:
        with pa.memory_map(str(path)) as source:
            reader = pa.ipc.open_stream(source)
            texts = (t for batch in reader for t in batch.column(text_column).to_pylist())
            yield from (
                text_row(t, text_column, f"{path}: row {i}", "null") for i, t in enumerate(texts)
            )
    except Exception as e:  # ArrowInvalid, KeyError (no such column), OSError
        raise BadFile(
            f"{path}: not a readable Arrow stream file with column {text_column!r} ({e}); "
            "rewrite or remove that file"
        ) from e


_READERS = {"json": _json_rows, "parquet": _parquet_rows, "text": _text_rows, "arrow": _arrow_rows}
