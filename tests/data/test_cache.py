import json
import threading
import time
from types import SimpleNamespace

import pytest

from titanlite.checks import resolve_global_batch
from titanlite.config import Training
from titanlite.data.cache import cache_dir, cache_root, prepare_token_cache
from titanlite.data.loader import build_train_loader
from titanlite.data.sources import TextSource, build_source
from titanlite.data.store_build import build_store


def test_cache_format_and_documents(data, tmp_path, tok):
    cache = prepare_token_cache(build_source("local", str(data)), tok, str(tmp_path / "c"))
    docs = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    encoded = [tok.encode(d, bos=True, eos=True) for d in docs]
    assert cache.num_docs == len(docs) and cache.num_tokens == sum(map(len, encoded))
    for i in (0, 57, len(docs) - 1):
        assert cache.document(i).tolist() == encoded[i]


def test_cache_key_is_stable(tmp_path):
    """Existing caches stay valid: the directory name is a fixed function of format version,
    source fingerprint and tokenizer identity."""
    src = TextSource("mine", "fp0", False, lambda: iter(["a b c"]))
    tokenizer = SimpleNamespace(
        identity="tok0", n_words=8, encode_batch=lambda docs, bos, eos: [[1, 2, 3] for _ in docs]
    )
    cache = prepare_token_cache(src, tokenizer, str(tmp_path))
    assert cache.path == cache_root(str(tmp_path)) / "mine-10c6d90f49b90caf"
    assert cache.document(0).tolist() == [1, 2, 3] and cache.meta["version"] == 2


def test_cache_reuse_does_not_retokenize(data, tmp_path, tok, monkeypatch):
    cache_dir = str(tmp_path / "cache")
    cfg = Training(dataset="local", dataset_path=str(data), data_cache_dir=cache_dir, seq_len=16)
    src = build_source("local", str(data))
    assert prepare_token_cache(src, tok, cfg.data_cache_dir).built
    monkeypatch.setattr(type(tok), "encode_batch", lambda *a, **k: pytest.fail("retokenized"))
    cache = prepare_token_cache(src, tok, cfg.data_cache_dir)
    assert not cache.built
    g, n = resolve_global_batch(cfg, 1)
    loader = build_train_loader(
        cfg,
        tok,
        dp_rank=0,
        dp_degree=1,
        global_batch_size=g,
        num_microbatches=n,
        vocab_size=tok.n_words,
        seed=0,
    )
    loader.close()
    assert [p.name for p in cache.path.parent.iterdir()] == [cache.path.name]  # no temp left


@pytest.mark.parametrize("rank", ["1", "2"])
def test_only_global_rank0_builds(data, tmp_path, tok, monkeypatch, rank):
    """Rank 2 is the local rank 0 of a second node: it waits too, so shared storage is written
    once per job."""
    src = build_source("local", str(data))
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", "0")
    final = cache_dir(src, tok, str(tmp_path / "c"))
    builder = threading.Timer(1.0, build_store, (src, tok, final))
    builder.start()
    start = time.monotonic()
    cache = prepare_token_cache(src, tok, str(tmp_path / "c"), timeout_s=60)
    builder.join()
    assert not cache.built and cache.num_docs == 120 and time.monotonic() - start >= 1.0
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert prepare_token_cache(src, tok, str(tmp_path / "other")).built


def test_waiting_rank_times_out_with_the_fix(data, tmp_path, tok, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    src = build_source("local", str(data))
    with pytest.raises(TimeoutError, match="shared by all nodes.*prepare_data.py"):
        prepare_token_cache(src, tok, str(tmp_path / "c"), timeout_s=0.2)
    assert not (tmp_path / "c").exists()  # nothing was built
