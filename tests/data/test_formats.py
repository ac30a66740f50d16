"""Every common format of local files: compressed, Arrow, and several formats in one source."""

import bz2
import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from titanlite.config import ConfigError
from titanlite.data.sources import local_source

DOCS = [f"doc {i}: " + "word " * (i % 5) for i in range(12)]


def jsonl(docs) -> bytes:
    return "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()


def write_arrow(path, docs):
    table = pa.table({"text": docs})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


@pytest.mark.parametrize(
    "suffix, compress",
    [
        (".jsonl.zst", zstandard.ZstdCompressor().compress),
        (".jsonl.gz", gzip.compress),
        (".json.bz2", bz2.compress),
    ],
)
@pytest.mark.parametrize("max_bad_rows", [0, 3])
def test_compressed_json_lines(tmp_path, suffix, compress, max_bad_rows):
    path = tmp_path / f"d{suffix}"
    path.write_bytes(compress(jsonl(DOCS)))
    assert list(local_source(str(path), max_bad_rows=max_bad_rows).documents()) == DOCS


@pytest.mark.parametrize("max_bad_rows", [0, 3])
def test_arrow_files(tmp_path, max_bad_rows):
    write_arrow(tmp_path / "a.arrow", DOCS)
    assert list(local_source(str(tmp_path), max_bad_rows=max_bad_rows).documents()) == DOCS


@pytest.mark.parametrize("max_bad_rows", [0, 3])
def test_several_formats_in_one_source_in_path_order(tmp_path, max_bad_rows):
    (tmp_path / "1.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl(DOCS[:3])))
    pq.write_table(pa.table({"text": DOCS[3:6]}), tmp_path / "2.parquet")
    pq.write_table(pa.table({"text": DOCS[6:8]}), tmp_path / "3.parquet")
    (tmp_path / "4.txt").write_text(DOCS[8])
    write_arrow(tmp_path / "5.arrow", DOCS[9:])
    src = local_source(str(tmp_path), max_bad_rows=max_bad_rows)
    assert list(src.documents()) == DOCS
    assert "5 arrow/json/parquet/text files" in src.describe()
    with pytest.raises(ConfigError, match="mixes formats .* stream one format per source"):
        local_source(str(tmp_path), streaming=True)


def test_unreadable_formats_are_one_line(tmp_path):
    (tmp_path / "a.csv").write_text("text\nx\n")
    with pytest.raises(ConfigError, match=r"cannot read .*a.csv.*supported extensions"):
        local_source(str(tmp_path / "a.csv"))
    (tmp_path / "b.arrow").write_bytes(b"not arrow at all")
    for max_bad_rows in (0, 1):
        with pytest.raises(ConfigError, match="b.arrow: not a readable Arrow stream file"):
            list(local_source(str(tmp_path / "b.arrow"), max_bad_rows=max_bad_rows).documents())
