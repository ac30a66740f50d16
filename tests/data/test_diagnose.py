"""Bad local data is one clear error naming the file and the line (or row), map-style and
streamed, plain and compressed; good files of the same shapes still load."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import train
from titanlite.config import ConfigError
from titanlite.data.sources import local_source

GOOD, BROKEN = '{"text": "one"}\n', '{"text": "two\n'


def documents(path, streaming: bool) -> list[str]:
    source = local_source(str(path), streaming=streaming)
    return list(source.stream.texts(source.stream.open()) if streaming else source.documents())


def write(path, content: str | bytes):
    if path.suffix == ".gz":
        content = gzip.compress(content.encode() if isinstance(content, str) else content)
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return path


BAD = {
    # file name: (content, what the error says after the file's path)
    "broken.jsonl": (GOOD + BROKEN + GOOD, ":2: not valid JSON"),
    "broken.jsonl.gz": (GOOD * 3 + BROKEN, ":4: not valid JSON"),
    "no_text.jsonl": (GOOD + '{"body": "x"}\n', ":2: no 'text' (keys: ['body'])"),
    "null_text.jsonl": (GOOD + '{"text": null}\n' + GOOD, ":2: no 'text'"),
    "not_object.jsonl": (GOOD + "[1, 2]\n", ":2: a JSON list, not an object"),
    "rows.json": ('[{"text": "a"},\n {"body": "b"}]', ": item 1: no 'text'"),
    "latin1.txt": ("caf\xe9".encode("latin-1"), ": not UTF-8 text"),
    "empty.jsonl": ("", " is empty: remove it"),
}


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "stream"])
@pytest.mark.parametrize("name", list(BAD))
def test_bad_file_is_named_with_its_line(tmp_path, name, streaming):
    content, expected = BAD[name]
    path = write(tmp_path / name, content)
    with pytest.raises(ConfigError) as err:
        documents(path, streaming)
    assert f"{path}{expected}" in str(err.value)


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


def test_train_stops_with_one_line_naming_the_row(tmp_path, capsys):
    data = write(tmp_path / "corpus.jsonl", GOOD * 50 + BROKEN)
    args = ["--job.config_file", "debug_model.toml", "--model.vocab_limit", "512",
            "--training.steps", "1", "--training.dataset", "local", "--training.dataset_path",
            str(data), "--job.dump_folder", str(tmp_path / "out")]  # fmt: skip
    assert train.main(args) == 2
    err = capsys.readouterr().err
    assert f"{data}:51: not valid JSON" in err and "Traceback" not in err, err
