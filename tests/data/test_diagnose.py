"""Bad local data is one clear error naming the file and the line (or row), map-style and
streamed, plain and compressed; good files of the same shapes still load. With
training.dataset_max_bad_rows a bad row is skipped and counted instead, up to the limit."""

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import TINY_TRAIN

import train
from titanlite.config import ConfigError
from titanlite.data import diagnose
from titanlite.data.diagnose import SkippedRows
from titanlite.data.sources import local_source

GOOD, BROKEN = '{"text": "one"}\n', '{"text": "two\n'


def documents(path, streaming: bool, max_bad_rows: int = 0) -> list[str]:
    """The documents of `path`; with max_bad_rows, the bad rows skipped are in `counted`."""
    source = local_source(str(path), streaming=streaming, max_bad_rows=max_bad_rows)
    if not streaming:
        docs = list(source.documents())
        counted.append(source.skipped)
        return docs
    counted.append(SkippedRows(max_bad_rows))
    return list(source.stream.texts(source.stream.open(), counted[-1]))


counted: list[SkippedRows | None] = []


def write(path, content: str | bytes):
    if path.suffix == ".gz":
        content = gzip.compress(content.encode() if isinstance(content, str) else content)
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return path


BAD = {
    # file name: (content, what the error says after the file's path, the documents left when
    # the bad row is skipped: None where the whole file is bad)
    "broken.jsonl": (GOOD + BROKEN + '{"text": "three"}\n', ":2: not valid JSON", ["one", "three"]),
    "broken.jsonl.gz": (GOOD * 3 + BROKEN, ":4: not valid JSON", ["one"] * 3),
    "no_text.jsonl": (GOOD + '{"body": "x"}\n', ":2: no 'text' (keys: ['body'])", ["one"]),
    "null_text.jsonl": (GOOD + '{"text": null}\n' + GOOD, ":2: no 'text'", ["one"] * 2),
    "int_text.jsonl": ('{"text": 7}\n' + GOOD, ":1: 'text' is 7 (int), not text", ["one"]),
    "not_object.jsonl": (GOOD + "[1, 2]\n", ":2: a JSON array, not an object", ["one"]),
    "rows.json": ('[{"text": "a"},\n {"body": "b"}]', ": item 1: no 'text'", ["a"]),
    "latin1.txt": ("caf\xe9".encode("latin-1"), ": not UTF-8 text", None),
    "empty.jsonl": ("", " is empty: fix or remove it", None),
}


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "stream"])
@pytest.mark.parametrize("name", list(BAD))
def test_bad_file_is_named_with_its_line(tmp_path, name, streaming):
    content, expected, _ = BAD[name]
    path = write(tmp_path / name, content)
    with pytest.raises(ConfigError) as err:
        documents(path, streaming)
    assert f"{path}{expected}" in str(err.value)


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "stream"])
@pytest.mark.parametrize("name", list(BAD))
def test_bad_row_is_skipped_and_counted_a_bad_file_still_stops(tmp_path, name, streaming):
    content, expected, left = BAD[name]
    path = write(tmp_path / name, content)
    if left is None:
        with pytest.raises(ConfigError, match="not UTF-8|is empty"):
            documents(path, streaming, max_bad_rows=5)
        return
    assert documents(path, streaming, max_bad_rows=5) == left
    assert counted[-1].count == 1 and counted[-1].last.startswith(f"{path}{expected}")


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "stream"])
def test_skipping_keeps_the_good_rows_in_order_up_to_the_limit(tmp_path, streaming):
    """Three files, bad rows among good ones: the good rows remain, in file and line order;
    one bad row more than the limit stops with the row that crossed it and the limit."""
    lines, good = [], []
    for f in range(3):
        rows = [json.dumps({"text": f"file {f} row {i}"}) for i in range(6)]
        rows[1 + f] = '{"text": "cut'  # one broken line per file, at lines 2, 3, 4
        good += [json.loads(r)["text"] for r in rows if not r.endswith("cut")]
        lines.append(write(tmp_path / f"part{f}.jsonl", "\n".join(rows) + "\n"))
    assert documents(tmp_path / "*.jsonl", streaming, max_bad_rows=3) == good
    assert counted[-1].count == 3 and counted[-1].last.startswith(f"{lines[2]}:4: not valid")
    with pytest.raises(ConfigError) as err:
        documents(tmp_path / "*.jsonl", streaming, max_bad_rows=2)
    assert str(err.value).startswith(f"{lines[2]}:4: not valid JSON")
    assert "bad row 3, more than training.dataset_max_bad_rows = 2 allows" in str(err.value)


def test_parquet_rows_without_text_are_skipped(tmp_path):
    pq.write_table(pa.table({"text": ["a", None, "c", None]}), tmp_path / "nulls.parquet")
    assert documents(tmp_path / "nulls.parquet", False, max_bad_rows=2) == ["a", "c"]
    assert counted[-1].last == f"{tmp_path / 'nulls.parquet'}: row 3: no 'text' (null)"


def test_an_unreadable_file_is_named_before_reading(tmp_path, monkeypatch):
    """os.access stands in for chmod 000, which does not stop root (the tests may run as
    root)."""
    locked = write(tmp_path / "locked.jsonl", GOOD)
    monkeypatch.setattr(diagnose.os, "access", lambda f, mode: Path(f).name != locked.name)
    with pytest.raises(ConfigError, match=f"data file {locked} cannot be read by this user"):
        local_source(str(locked))


def test_a_compressed_blank_file_is_named_when_datasets_fails_on_it(tmp_path):
    """Not zero bytes on disk, so not refused up front; streamed, it simply gives no text."""
    path = write(tmp_path / "blank.jsonl.gz", "\n \n")
    with pytest.raises(ConfigError, match=r"blank\.jsonl\.gz: no rows, only blank lines"):
        documents(path, streaming=False)
    assert documents(path, streaming=True) == []


def test_the_bad_file_among_good_ones_is_the_one_named(tmp_path):
    for i in range(3):
        write(tmp_path / f"part{i}.jsonl", GOOD * 5)
    write(tmp_path / "part3.jsonl", GOOD * 4 + BROKEN)
    with pytest.raises(ConfigError, match=r"part3\.jsonl:5: not valid JSON"):
        documents(tmp_path / "*.jsonl", False)


def test_parquet_with_null_text_or_a_broken_footer(tmp_path):
    pq.write_table(pa.table({"text": ["a", None, "c"]}), tmp_path / "nulls.parquet")
    with pytest.raises(ConfigError, match=r"nulls\.parquet: row 1: no 'text' \(null\)"):
        documents(tmp_path / "nulls.parquet", False)
    write(tmp_path / "cut.parquet", b"PAR1 not a parquet file")
    with pytest.raises(ConfigError, match=r"cut\.parquet: not a readable parquet file"):
        documents(tmp_path / "cut.parquet", False)


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "stream"])
def test_good_files_of_the_same_shapes_load(tmp_path, streaming):
    write(tmp_path / "lines.jsonl.gz", GOOD + "\n" + '{"text": "", "id": 3}\n')  # blank line, ""
    assert documents(tmp_path / "lines.jsonl.gz", streaming) == ["one"]
    write(tmp_path / "rows.json", json.dumps([{"text": "a"}, {"text": "b"}], indent=1))
    assert documents(tmp_path / "rows.json", streaming) == ["a", "b"]


def test_train_counts_skipped_rows_in_its_log_and_stops_past_the_limit(tmp_path, capsys):
    """train.py streaming with dataset_max_bad_rows 1: the first bad row is skipped and its
    count is in every log line; the second, met steps later, stops the run with one line
    naming it and the limit (said by the rank that read it, mid-run)."""
    data = write(tmp_path / "corpus.jsonl", GOOD + BROKEN + GOOD * 250 + BROKEN + GOOD)
    args = [*TINY_TRAIN, "--training.steps", "20", "--training.dataset", "local",
            "--training.dataset_path", str(data), "--training.dataset_streaming",
            "--training.dataset_max_bad_rows", "1",
            "--job.dump_folder", str(tmp_path / "out")]  # fmt: skip
    assert train.main(args) == 2
    out, err = capsys.readouterr()
    logged = [line for line in out.splitlines() if " INFO step " in line]
    assert len(logged) >= 2 and all(line.endswith("skipped_rows 1") for line in logged), out
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"titanlite: error: {data}:253: not valid JSON ("), err
    assert last.endswith(
        "bad row 2, more than training.dataset_max_bad_rows = 1 allows; fix or remove the bad "
        "rows, or raise the limit"
    )
    assert "Traceback" not in out + err
