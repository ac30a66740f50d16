import numpy as np
import pytest

from titanlite.data.packing import Packer, cached_samples, collate


@pytest.mark.parametrize("seq_len", [4, 16, 200])
def test_packed_samples_are_the_single_stream(store, texts, tok, seq_len):
    """Windows over the concatenation of every document, as the single-file cache gave them,
    including windows that start in one shard and end in the next."""
    stream = np.concatenate([tok.encode(t, bos=True, eos=True) for t in texts])
    get, count = cached_samples(store, seq_len, packing=True)
    w = seq_len + 1
    assert count == len(stream) // w
    starts = np.cumsum([s["num_tokens"] for s in store.meta["shards"]])
    crossing = [i for i in range(count) if np.any((i * w < starts) & (starts < (i + 1) * w))]
    assert crossing  # the boundary case is exercised
    for i in range(count):
        assert get(i).tolist() == stream[i * w : (i + 1) * w].tolist(), i


def test_unpacked_samples_are_documents_cut(store, texts, tok):
    get, count = cached_samples(store, 16, packing=False)
    assert count == len(texts) == store.num_docs
    assert len(store.meta["shards"]) == -(-len(texts) // store.docs_per_shard)
    for i, text in enumerate(texts):
        assert get(i).tolist() == tok.encode(text, bos=True, eos=True)[:17], i


@pytest.mark.parametrize("packing", [True, False])
def test_a_packer_gives_the_stores_samples_and_continues_from_its_carry(store, texts, tok, packing):
    """Documents read in order give the samples a token store gives at any index; a packer made
    from another's carry, mid-corpus, continues with the very next samples."""
    get, count = cached_samples(store, 16, packing)
    docs = [tok.encode(t, bos=True, eos=True) for t in texts]
    first = Packer(16, packing)
    got = [s.tolist() for d in docs[:50] for s in first.samples(d)]
    second = Packer(16, packing, first.carry())
    got += [s.tolist() for d in docs[50:] for s in second.samples(d)]
    assert got == [get(i).tolist() for i in range(count)]
    assert len(first.carry()) < 17 and (len(first.carry()) > 0) == packing


def test_collate_rejects_ids_outside_the_vocabulary():
    rows = [np.array([1, 2, 3], dtype=np.uint32), np.empty(0, dtype=np.uint32)]
    tokens, labels = collate(rows, 4, pad=0, vocab_size=4)  # padding and IGNORE_INDEX are fine
    assert labels.tolist() == [[2, 3, -100, -100], [-100] * 4]
    with pytest.raises(ValueError, match=r"token ids \[5, 7\].*vocab_size=4.*tokenizer"):
        collate([np.array([1, 7, 5, 3], dtype=np.uint32)], 4, pad=0, vocab_size=4)
    with pytest.raises(ValueError, match=r"token ids \[-5\]"):
        collate([np.array([1, -5], dtype=np.int64)], 4, pad=0, vocab_size=4)
    with pytest.raises(ValueError, match=r"token ids \[9\]"):  # an input that is no label
        collate([np.array([9, 1], dtype=np.uint32)], 4, pad=0, vocab_size=4)
