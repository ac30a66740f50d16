"""Why local data files cannot be trained on, named down to the file and line.

`datasets` reports a malformed JSON line, a file it cannot decode or a broken parquet footer as
"An error occurred while generating the dataset", and fills a missing text column with None,
which would silently drop the document. These checks run only after something went wrong (or a
None text was met), so a good corpus of any size pays nothing for them; they then read the files
in order and stop at the first problem.
"""

import json
from pathlib import Path

from titanlite.config import ConfigError


def check_not_empty(files: list[Path]) -> None:
    """An empty data file is a mistake upstream (a failed export or copy), not an empty shard.
    Sizes only: a corpus of a million small files is not read here, on every rank."""
    empty = [str(f) for f in files if f.stat().st_size == 0]
    if empty:
        more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
        raise ConfigError(f"data file {empty[0]} is empty{more}: remove it from the dataset path")


def first_problem(files: list[Path], builder: str, text_column: str) -> str | None:
    """'file:line: what' for the first row that cannot give a text, or None when none is found."""
    find = {"json": _json_problem, "parquet": _parquet_problem, "text": _text_problem}[builder]
    for f in files:
        if problem := find(f, text_column):
            return problem
    return None


def data_error(
    files: list[Path], builder: str, text_column: str, fallback: str | None = None
) -> ConfigError | None:
    """The one-line error for bad data: the first problem found, else `fallback` (None: no
    error; the caller re-raises what it met, since the files look right)."""
    problem = first_problem(files, builder, text_column) if files else None
    if problem:
        return ConfigError(problem + _FIX[builder])
    return ConfigError(fallback) if fallback else None


_FIX = {
    "json": "; fix or remove that row (JSON lines: one object per line, text in the text column)",
    "parquet": "; rewrite or remove that file",
    "text": "; re-encode that file as UTF-8 or remove it",
}


def _open_text(path: Path):
    import fsspec  # datasets' dependency: the same decompressors datasets uses

    return fsspec.open(str(path), "rt", compression="infer", encoding="utf-8")


def _json_problem(path: Path, text_column: str) -> str | None:
    try:
        with _open_text(path) as f:
            rows = 0
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                rows += 1
                try:
                    row = json.loads(line)
                except ValueError as e:
                    if n == 1:  # perhaps one JSON document over several lines
                        return _whole_document_problem(path, text_column)
                    return f"{path}:{n}: not valid JSON ({e})"
                if n == 1 and isinstance(row, list):  # one JSON document: a list of rows
                    return _whole_document_problem(path, text_column)
                if problem := _row_problem(row, text_column):
                    return f"{path}:{n}: {problem}"
            if not rows:  # e.g. a compressed empty file: not zero bytes on disk
                return f"{path}: no rows, only blank lines"
    except UnicodeDecodeError as e:
        return f"{path}: not UTF-8 text ({e})"
    except (OSError, EOFError) as e:  # a truncated or corrupt compressed file
        return f"{path}: cannot be read ({e})"
    return None


def _whole_document_problem(path: Path, text_column: str) -> str | None:
    """A .json file may be one JSON document (a list of rows) rather than JSON lines."""
    try:
        with _open_text(path) as f:
            doc = json.load(f)
    except ValueError as e:
        return f"{path}:1: not valid JSON ({e})"
    rows = doc if isinstance(doc, list) else [doc]
    for i, row in enumerate(rows):
        if problem := _row_problem(row, text_column):
            return f"{path}: item {i}: {problem}"
    return None


def _row_problem(row, text_column: str) -> str | None:
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    if row.get(text_column) is None:
        return f"no {text_column!r} (keys: {sorted(row)[:8]})"
    return None


def _parquet_problem(path: Path, text_column: str) -> str | None:
    import pyarrow.parquet as pq  # datasets' dependency

    try:
        column = pq.read_table(path, columns=[text_column]).column(0)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, KeyError... for bad files
        return f"{path}: not a readable parquet file with column {text_column!r} ({e})"
    if column.null_count:
        row = column.is_null().to_pylist().index(True)
        return f"{path}: row {row}: no {text_column!r} (null)"
    return None


def _text_problem(path: Path, text_column: str) -> str | None:
    try:
        with _open_text(path) as f:
            f.read()
    except UnicodeDecodeError as e:
        return f"{path}: not UTF-8 text ({e})"
    except (OSError, EOFError) as e:
        return f"{path}: cannot be read ({e})"
    return None
