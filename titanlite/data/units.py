"""Local data files cut into units of work that a process reads on its own, straight from the
files: byte ranges of plain JSON lines files (cut at line ends), row-group ranges of parquet
files, and whole files (compressed, .txt, .arrow, one-document .json) grouped up to a size.

Reading the units one after the other gives the rows `titanlite.data.diagnose.read_rows` gives
for the files, in the same order, so a store built unit by unit holds the documents a build from
the whole files holds. Nothing is copied first: each reader streams its part of its file.
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from titanlite.data.diagnose import BadFile, Row, json_row, read_rows, text_row
from titanlite.data.sources import COMPRESSION

MIN_UNIT_BYTES, MAX_UNIT_BYTES = 1 << 20, 64 << 20
UNITS_PER_CORPUS = 256  # a small corpus is still cut into enough units for a pool of workers


@dataclass(frozen=True)
class Part:
    """Rows of one file: `start`/`stop` are bytes (json lines), row groups (parquet), or None
    for the whole file."""

    path: str
    builder: str
    start: int | None = None
    stop: int | None = None


Unit = tuple[Part, ...]


def unit_bytes(files: list[Path]) -> int:
    """The size a unit is cut to: a 256th of the corpus, within [1 MiB, 64 MiB]. It depends on
    the files alone (not on the worker count), so every machine and every rerun cuts alike."""
    total = sum(f.stat().st_size for f in files)
    return min(max(total // UNITS_PER_CORPUS, MIN_UNIT_BYTES), MAX_UNIT_BYTES)


def plan_units(runs: list[tuple[str, list[Path]]], target: int) -> list[Unit]:
    """The files of `runs` (builder, files) in order as units of about `target` bytes: big
    files cut where their format allows, small whole files grouped."""
    units: list[Unit] = []
    group: list[Part] = []
    size = 0
    for builder, files in runs:
        if group:  # a unit holds one format: its errors name that format's fix
            units.append(tuple(group))
            group, size = [], 0
        for f in files:
            cuts = _cuts(f, builder, target)
            if cuts is None:  # a whole file: grouped with its neighbours up to `target`
                if group and size + f.stat().st_size > target:
                    units.append(tuple(group))
                    group, size = [], 0
                group.append(Part(str(f), builder))
                size += f.stat().st_size
                continue
            if group:
                units.append(tuple(group))
                group, size = [], 0
            units += [(Part(str(f), builder, a, b),) for a, b in cuts]
    if group:
        units.append(tuple(group))
    return units


def _cuts(path: Path, builder: str, target: int) -> list[tuple[int, int]] | None:
    """[start, stop) ranges a file is read in, or None to read it whole."""
    if path.stat().st_size <= target:
        return None
    if builder == "parquet":
        return _row_group_cuts(path, target)
    if builder == "json" and not path.name.endswith(COMPRESSION) and _is_json_lines(path):
        size = path.stat().st_size
        return [(a, min(a + target, size)) for a in range(0, size, target)]
    return None


def _is_json_lines(path: Path) -> bool:
    """Its first non-blank line is a JSON object: rows are lines (else the file may be one JSON
    document, which only a whole read parses)."""
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                try:
                    return isinstance(json.loads(line), dict)
                except ValueError:
                    return False
    return False


def _row_group_cuts(path: Path, target: int) -> list[tuple[int, int]] | None:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception:  # a broken file: read whole, where the reader names the problem
        return None
    cuts, start, size = [], 0, 0
    for g in range(meta.num_row_groups):
        size += meta.row_group(g).total_byte_size
        if size >= target or g == meta.num_row_groups - 1:
            cuts.append((start, g + 1))
            start, size = g + 1, 0
    return cuts or None


def unit_rows(unit: Unit, text_column: str) -> Iterator[Row]:
    for part in unit:
        if part.start is None:
            yield from read_rows(Path(part.path), part.builder, text_column)
        elif part.builder == "parquet":
            yield from _row_group_rows(part, text_column)
        else:
            yield from _line_rows(part, text_column)


def _line_rows(part: Part, text_column: str) -> Iterator[Row]:
    """The JSON lines that start in bytes [start, stop) of the file, numbered as in the file."""
    path = part.path
    with open(path, "rb") as f:
        at = part.start
        if at > 0:  # the line holding byte start - 1 belongs to the unit before
            f.seek(at - 1)
            at += len(f.readline()) - 1
        while at < part.stop and (line := f.readline()):
            at += len(line)
            if not line.strip():
                continue
            try:
                row, error = json.loads(line.decode("utf-8")), None
            except UnicodeDecodeError as e:
                what = f"{path}: not UTF-8 text ({e}); re-encode it as UTF-8 or remove it"
                raise BadFile(what) from e
            except ValueError as e:
                row, error = None, e
            if isinstance(row, dict) and isinstance(text := row.get(text_column), str):
                yield text, None  # a good row needs no line number
                continue
            where = f"{path}:{_line_number(path, at - len(line))}"
            yield (
                (None, f"{where}: not valid JSON ({error})")
                if error
                else json_row(row, text_column, where)
            )


def _line_number(path: str, offset: int) -> int:
    """The 1-based number of the line starting at byte `offset`, counted only for a bad row."""
    with open(path, "rb") as f:
        count, done = 1, 0
        while done < offset:
            block = f.read(min(1 << 24, offset - done))
            count, done = count + block.count(b"\n"), done + len(block)
    return count


def _row_group_rows(part: Part, text_column: str) -> Iterator[Row]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(part.path)
        row = sum(pf.metadata.row_group(g).num_rows for g in range(part.start))
        batches = pf.iter_batches(
            batch_size=1024, row_groups=range(part.start, part.stop), columns=[text_column]
        )
        for batch in batches:
            for text in batch.column(0).to_pylist():
                yield text_row(text, text_column, f"{part.path}: row {row}", "null")
                row += 1
    except BadFile:
        raise
    except Exception as e:
        raise BadFile(
            f"{part.path}: not a readable parquet file with column {text_column!r} ({e}); "
            "rewrite or remove that file"
        ) from e


def count_rows(runs: list[tuple[str, list[Path]]]) -> int | None:
    """The rows of the files where no parse tells them (an upper bound of the documents: empty
    texts are skipped): parquet footers, one per .txt, the lines of plain JSON lines (a read at
    disk speed, ~1% of tokenizing them); None where only a full parse would (compressed files,
    Arrow, JSON documents)."""
    total = 0
    for builder, files in runs:
        for f in files:
            if builder == "text":
                total += 1
            elif builder == "parquet":
                import pyarrow.parquet as pq

                total += pq.ParquetFile(f).metadata.num_rows
            elif builder == "json" and not f.name.endswith(COMPRESSION) and _is_json_lines(f):
                total += _count_lines(f)
            else:
                return None
    return total


def _count_lines(path: Path) -> int:
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            lines, last = lines + block.count(b"\n"), block[-1:]
    return lines + (last != b"\n")
