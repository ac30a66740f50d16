import json
import threading
import time
from types import SimpleNamespace

import pytest

from titanlite.config import Training, resolve_global_batch
from titanlite.data import cache as cache_mod
from titanlite.data.cache import cache_root, prepare_token_cache
from titanlite.data.loader import build_train_loader
from titanlite.data.sources import TextSource, build_source


def test_cache_format_and_documents(data, tmp_path, tok):
    cache = prepare_token_cache(build_source("local", str(data)), tok, str(tmp_path / "c"))
    docs = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    assert cache.num_docs == len(docs) and cache.meta["num_tokens"] == len(cache.tokens)
    for i in (0, 57, len(docs) - 1):
        assert cache.tokens[cache.offsets[i] : cache.offsets[i + 1]].tolist() == tok.encode(
            docs[i], bos=True, eos=True
        )


def test_cache_key_is_stable(tmp_path):
    """Existing caches stay valid: the directory name is a fixed function of version, source
    fingerprint and tokenizer identity."""
    src = TextSource("mine", "fp0", False, lambda: iter(["a b c"]))
    tokenizer = SimpleNamespace(
        identity="tok0", encode_batch=lambda docs, bos, eos: [[1, 2, 3] for _ in docs]
    )
    cache = prepare_token_cache(src, tokenizer, str(tmp_path))
    assert cache.path == cache_root(str(tmp_path)) / "mine-093564a6b1c860d7"
    assert cache.tokens.tolist() == [1, 2, 3] and cache.meta["version"] == 1


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
    )
    loader.close()
    assert [p.name for p in cache.path.parent.iterdir()] == [cache.path.name]  # no temp left


def test_other_local_ranks_wait_for_rank0(data, tmp_path, tok, monkeypatch):
    src = build_source("local", str(data))
    final = prepare_token_cache(src, tok, str(tmp_path / "c")).path
    for f in final.iterdir():
        f.unlink()
    final.rmdir()
    monkeypatch.setenv("LOCAL_RANK", "1")
    builder = threading.Timer(1.0, cache_mod._build_cache, (src, tok, final))
    builder.start()
    start = time.monotonic()
    cache = prepare_token_cache(src, tok, str(tmp_path / "c"))
    builder.join()
    assert not cache.built and cache.num_docs == 120 and time.monotonic() - start >= 1.0
