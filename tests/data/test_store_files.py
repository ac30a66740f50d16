"""Stores built from local files read unit by unit (titanlite.data.store_files) hold the bytes a
build from the documents as `datasets` (or the row reader) reads them holds, cut into any units,
resumed after a failure, with nothing copied into the Hugging Face cache."""

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from tests.data.conftest import SHARD, ragged_docs
from titanlite.config import ConfigError
from titanlite.data import store_files
from titanlite.data.diagnose import read_rows
from titanlite.data.sources import local_source
from titanlite.data.store_build import build_store
from titanlite.data.units import plan_units, unit_rows


def _jsonl(docs, bad_at=()) -> str:
    rows = [json.dumps({"text": d}) for d in docs]
    for i in bad_at:  # a cut-short row, then a row without text
        rows[i] = '{"text": "cut' if i % 2 else json.dumps({"body": docs[i]})
    empty = [json.dumps({"text": ""})] * 20  # skipped: a unit or two of no documents
    return "\n".join(rows[:5] + [""] + empty + rows[5:]) + "\n"  # a blank line, skipped


@pytest.fixture
def corpus(tmp_path):
    """~150 documents in every format: a JSON lines file and a parquet file of several row groups
    (cut into units), .gz/.zst JSON lines, a JSON array, .txt and .arrow files, empty texts."""
    rng, d = np.random.default_rng(1), tmp_path / "corpus"
    d.mkdir()
    docs = ragged_docs(rng, 150, 30)

    def write(bad_at=()):
        (d / "a.jsonl").write_text(_jsonl(docs[:60], bad_at))
        pq.write_table(pa.table({"text": docs[60:90] + [""]}), d / "b.parquet", row_group_size=7)
        (d / "c.jsonl.gz").write_bytes(gzip.compress(_jsonl(docs[90:100]).encode()))
        comp = zstandard.ZstdCompressor().compress(_jsonl(docs[100:110]).encode())
        (d / "d.jsonl.zst").write_bytes(comp)
        (d / "e.json").write_text(json.dumps([{"text": t} for t in docs[110:120]], indent=1))
        for i, t in enumerate(docs[120:130]):
            (d / f"f{i}.txt").write_text(t)
        table = pa.table({"text": docs[130:]})
        with (
            pa.OSFile(str(d / "g.arrow"), "wb") as sink,
            pa.ipc.new_stream(sink, table.schema) as writer,
        ):
            writer.write_table(table)
        return str(d)

    return write


def build(source, out, unit_size=0, workers=0):
    return build_store(source, TOK, out, workers, docs_per_shard=SHARD, unit_size=unit_size)


@pytest.fixture(autouse=True)
def _tok(tok):
    global TOK
    TOK = tok


def files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize("max_bad_rows", [0, 3])
def test_units_give_the_bytes_of_a_build_from_the_documents(corpus, tmp_path, max_bad_rows):
    bad_at = (3, 40) if max_bad_rows else ()
    source = local_source(corpus(bad_at), max_bad_rows=max_bad_rows)
    local, source.local = source.local, None  # the build from documents() (datasets' reading)
    ref = build(source, tmp_path / "ref")
    source.local = local
    cache = Path(os.environ["HF_HOME"])  # tests/conftest.py's: nothing more may land there
    before = sorted(cache.rglob("*")) if cache.exists() else []
    units = plan_units(source.local.runs, 200)
    kinds = {(p.builder, p.start is None) for u in units for p in u}
    assert {("json", False), ("parquet", False), ("text", True)} <= kinds  # cut and grouped
    got = build(source, tmp_path / "units", unit_size=200)
    assert got == ref and files(tmp_path / "units") == files(tmp_path / "ref")
    assert (sorted(cache.rglob("*")) if cache.exists() else []) == before
    if max_bad_rows:
        assert ref["skipped_rows"] == 2 and "a.jsonl:62: no 'text'" in ref["last_skipped_row"]


def test_a_bad_row_is_named_by_file_and_line_within_a_cut_file(corpus, tmp_path):
    source = local_source(corpus(bad_at=(41,)))
    with pytest.raises(ConfigError, match=r"a.jsonl:63: not valid JSON .*fix or remove"):
        build(source, tmp_path / "out", unit_size=200)
    with pytest.raises(ConfigError, match="more than training.dataset_max_bad_rows = 1"):
        build(local_source(corpus(bad_at=(3, 41)), max_bad_rows=1), tmp_path / "o", 200)


@pytest.mark.parametrize("stop", ["unit 9", "shard 0"])  # shard 0 fills after an empty unit
def test_a_failed_build_resumes_keeping_shards_and_pieces(corpus, tmp_path, monkeypatch, stop):
    """A build stopped by an error (tokenizing unit 9, or writing shard 0, right after unit 2,
    of no documents) keeps its written shards, the units copied into them in its ledger (never
    one whose documents are not all written) and its other pieces; the rerun reads only the
    units it lacks and publishes the bytes of a fresh build."""
    source = local_source(corpus())
    build(source, tmp_path / "fresh", unit_size=200)
    real_unit, real_shard, read = store_files.tokenize_unit, store_files.write_shard_tokens, []

    def failing_unit(folder, u, unit, **kw):
        if stop == f"unit {u}":
            raise OSError("killed")
        return real_unit(folder, u, unit, **kw)

    def failing_shard(folder, k, *args):
        if stop == f"shard {k}":
            raise OSError("killed")
        return real_shard(folder, k, *args)

    monkeypatch.setattr(store_files, "tokenize_unit", failing_unit)
    monkeypatch.setattr(store_files, "write_shard_tokens", failing_shard)
    with pytest.raises(OSError, match="killed"):
        build(source, tmp_path / "out", unit_size=200)
    partial = tmp_path / ".out.partial"
    kept = sorted(p.name for p in partial.glob("shard-*.idx.npy"))
    ledger = partial / store_files.LEDGER
    ledger = ledger.read_text().splitlines() if ledger.exists() else []
    assert sum(json.loads(e)["docs"] for e in ledger) <= len(kept) * SHARD
    if stop == "unit 9":
        assert kept and ledger and not (partial / "piece-000000.bin").exists()  # copied, deleted

    def counting(folder, u, unit, **kw):
        read.append(u)
        return real_unit(folder, u, unit, **kw)

    monkeypatch.setattr(store_files, "tokenize_unit", counting)
    monkeypatch.setattr(store_files, "write_shard_tokens", real_shard)
    reused = []
    build_store(source, TOK, tmp_path / "out", docs_per_shard=SHARD, unit_size=200,
                on_shard=lambda d, t, r: reused.append(r))  # fmt: skip
    assert read and 0 not in read and reused[: len(kept)] == [True] * len(kept)
    assert stop != "unit 9" or min(read) == 9
    assert files(tmp_path / "out") == files(tmp_path / "fresh")


def test_json_lines_cut_at_any_byte_give_each_row_once_in_order(corpus):
    """Cuts falling anywhere (inside a line, on its first byte, on its newline) lose no row and
    repeat none; parquet row groups likewise."""
    folder = Path(corpus(bad_at=(3, 40)))
    for builder, name in (("json", "a.jsonl"), ("parquet", "b.parquet")):
        whole = list(read_rows(folder / name, builder, "text"))
        for size in (3, *range(30, 60), 500):
            units = plan_units([(builder, [folder / name])], size)
            assert [r for u in units for r in unit_rows(u, "text")] == whole, (name, size)
