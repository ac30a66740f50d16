"""Prepared tokens read in place: Megatron-LM .bin/.idx pairs and several token stores in one
source give the documents and the training rows of the same text."""

import pickle
import struct

import numpy as np
import pytest
import torch

from titanlite.config import ConfigError, Training
from titanlite.data.prepared import MegatronTokens, is_prepared, open_tokens
from titanlite.data.sources import build_source

MEGATRON_CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}


def write_megatron(prefix, docs, dtype, sequences_per_doc=2):
    """Megatron-LM's indexed dataset (MMIDIDX v1): each document cut into sequences_per_doc
    sequences (sentences) back to back in the .bin."""
    seqs = [piece for d in docs for piece in np.array_split(np.asarray(d), sequences_per_doc)]
    sizes = np.array([len(s) for s in seqs], dtype=np.int32)
    pointers = (
        np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) * np.dtype(dtype).itemsize
    )
    doc_idx = np.arange(0, len(seqs) + 1, sequences_per_doc, dtype=np.int64)
    with open(f"{prefix}.bin", "wb") as f:
        f.write(np.concatenate(seqs).astype(dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, MEGATRON_CODES[np.dtype(dtype)],
                                                 len(seqs), len(doc_idx)))  # fmt: skip
        f.write(sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes())
    return prefix


def rows(cfg, tok, train_loader, steps=3):
    ld = train_loader(cfg, tok)
    out = [mb for _ in range(steps) for mb in ld.next_step()]
    ld.close()
    return out


def same_rows(a, b):
    for (at, al), (bt, bl) in zip(a, b, strict=True):
        assert torch.equal(at, bt) and torch.equal(al, bl)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_files_are_read_in_place(store, tmp_path, dtype):
    docs = [store.document(i) for i in range(store.num_docs)]
    prefix = write_megatron(tmp_path / "web_text_document", docs, dtype)
    assert is_prepared(f"{prefix}.bin") and is_prepared(str(prefix))
    m = MegatronTokens(str(prefix))
    assert (m.num_docs, m.num_tokens) == (store.num_docs, store.num_tokens)
    for i in (0, 7, store.num_docs - 1):
        assert np.array_equal(m.document(i), docs[i])
        assert np.shares_memory(m.document(i), m.tokens)  # a view of the map: no copy
    assert np.array_equal(m.token_range(100, 300), store.token_range(100, 300))
    again = pickle.loads(pickle.dumps(m))  # as a spawned data worker gets it
    assert np.array_equal(again.document(3), docs[3]) and len(pickle.dumps(m)) < 1000


@pytest.mark.parametrize("packing", [True, False])
def test_training_on_megatron_files_and_on_two_stores(
    data, texts, store, tok, tmp_path, packing, train_loader, build_tiny_store, write_jsonl
):
    """The rows of the text itself, from a Megatron pair and from the text split into two stores
    (dataset_path "first,second")."""
    common = dict(seq_len=16, local_batch_size=4, packing=packing)
    cache = str(tmp_path / "cache")
    ref = rows(Training(dataset_path=str(data), data_cache_dir=cache, **common), tok, train_loader)
    docs = [store.document(i) for i in range(store.num_docs)]
    prefix = write_megatron(tmp_path / "mega", docs, np.uint16)
    mega = Training(dataset="c4", dataset_path=f"{prefix}.idx", data_cache_dir=cache, **common)
    same_rows(ref, rows(mega, tok, train_loader))
    halves = []
    for k, part in enumerate((texts[:50], texts[50:])):
        src = build_source("local", str(write_jsonl(tmp_path / f"part{k}.jsonl", part)))
        build_tiny_store(tmp_path / f"store{k}", source=src)
        halves.append(str(tmp_path / f"store{k}"))
    both = ",".join(halves)
    chained = open_tokens(both, tok)
    assert (chained.num_docs, chained.num_tokens) == (store.num_docs, store.num_tokens)
    assert np.array_equal(
        chained.token_range(0, store.num_tokens), store.token_range(0, store.num_tokens)
    )
    assert np.array_equal(chained.document(50), store.document(50))
    same_rows(
        ref, rows(Training(dataset_path=both, data_cache_dir=cache, **common), tok, train_loader)
    )
    assert "token store" in build_source("local", both).describe()


def test_a_bad_megatron_index_is_one_line(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\0" * 8)
    (tmp_path / "x.idx").write_bytes(b"not an index at all, no header here")
    with pytest.raises(ConfigError, match="x.idx is not a Megatron-LM index"):
        MegatronTokens(str(tmp_path / "x"))
    write_megatron(tmp_path / "y", [np.arange(10)], np.uint16)
    (tmp_path / "y.bin").write_bytes(b"\0" * 4)
    with pytest.raises(ConfigError, match="y.bin does not hold the tokens its .idx describes"):
        MegatronTokens(str(tmp_path / "y"))
