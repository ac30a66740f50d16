"""Sharded streaming (titanlite.data.stream, with training.dataset_streaming): each dp rank reads
its share of the files, the global batch does not depend on the microbatch split at a fixed dp
degree, and a resume continues exactly where the checkpoint was taken without replaying the
stream."""

import shutil

import pytest
import torch
from conftest import TINY_TRAIN, assert_nested_equal, read_jsonl, train_many
from torch import nn

import train
from titanlite.checkpoint import CheckpointManager, plan_load
from titanlite.config import Checkpoint, Training
from titanlite.data.packing import cached_samples
from titanlite.data.sources import local_source
from titanlite.data.stream import DOCS_PER_CALL, validation_samples
from titanlite.train_state import TrainState

SEQ, G = 16, 8


class CountingTokenizer:
    """The real tokenizer, recording every document it is asked to tokenize."""

    def __init__(self, tok):
        self.tok, self.docs = tok, []

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode_batch(self, texts, **kw):
        self.docs += texts
        return self.tok.encode_batch(texts, **kw)


def stream_cfg(folder, **kw):
    base = dict(dataset="local", dataset_path=str(folder / "*.jsonl"), dataset_streaming=True)
    return Training(**{**base, "seq_len": SEQ, "local_batch_size": 4, "global_batch_size": G, **kw})


@pytest.mark.parametrize("num_files", [4, 3])
def test_each_dp_rank_tokenizes_only_its_share(
    tmp_path, tok, num_files, write_shards, train_loader
):
    """4 files over 2 ranks: each rank reads 2 files; 3 files: each reads all of them but
    tokenizes every other document. Either way the ranks' documents are disjoint halves."""
    docs = write_shards(tmp_path, num_files, 24)
    cfg, shares = stream_cfg(tmp_path, packing=False), []
    for r in range(2):
        counting = CountingTokenizer(tok)
        ld = train_loader(cfg, counting, r, 2)
        for _ in range(len(docs) // G + 2):  # one row per document: past the end of its share
            ld.next_step()
        ld.close()
        shares.append(set(counting.docs))
    assert len(shares[0]) == len(shares[1]) == len(docs) // 2
    assert shares[0].isdisjoint(shares[1]) and shares[0] | shares[1] == set(docs)
    if num_files == 4:  # file-level: rank r reads files r and r + 2
        assert shares[0] == set(docs[:24] + docs[48:72])


@pytest.mark.parametrize("packing", [True, False])
def test_global_batch_invariant_to_split_at_fixed_dp(
    tmp_path, tok, packing, write_shards, global_steps
):
    write_shards(tmp_path, 4, 40)
    cfg = stream_cfg(tmp_path, packing=packing)
    for dp, splits in ((2, (4, 2, 1)), (1, (8, 1))):
        ref = [t for t, _ in global_steps(cfg, tok, dp, splits[0], steps=5)]
        for lb in splits[1:]:
            got = [t for t, _ in global_steps(cfg, tok, dp, lb, steps=5)]
            assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True)), (dp, lb)


@pytest.mark.parametrize("packing", [True, False])
def test_resume_mid_stream_is_exact_and_rereads_at_most_a_chunk(
    tmp_path, tok, packing, write_shards, train_loader
):
    """Resume at step 60 of 2 ranks' streams, run 20 steps (past a chunk boundary), resume
    again: every step equals the uninterrupted run's. The resumed loader tokenizes at most the
    rest of one chunk besides the rows it serves (no replay of the 60 steps before)."""
    write_shards(tmp_path, 4, 250)
    cfg, k, m, dp = stream_cfg(tmp_path, packing=packing), 60, 20, 2
    per_rank = G // dp
    for r in range(dp):
        run = train_loader(cfg, tok, r, dp)
        steps = [run.next_step() for _ in range(k + 2 * m)]
        run.close()
        resumed, ld = [], train_loader(cfg, tok, r, dp)
        for _ in range(k):
            ld.next_step()
        for _ in range(2):  # resume at k, then at k + m from the resumed loader's own state
            sd, stream = ld.state_dict(), ld.stream_state_dict()
            ld.close()
            assert stream["dp_rank"] == r and stream["dp_degree"] == dp
            ld = train_loader(cfg, tok, r, dp)
            ld.load_state_dict(sd, stream)
            resumed += [ld.next_step() for _ in range(m)]
        ld.close()
        for a, b in zip(steps[k:], resumed, strict=True):
            assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
        assert not torch.equal(steps[0][0][0], resumed[0][0][0])
        counting = CountingTokenizer(tok)
        late = train_loader(cfg, counting, r, dp)
        late.load_state_dict(sd, stream)  # at step k + m
        late.next_step()
        late.close()  # waits for the prefetch of the step after
        if packing:
            assert len(stream["carry"]) > 0  # a window ended mid-document: the carry is needed
        else:  # one document per row: the documents are countable
            bound = DOCS_PER_CALL + 2 * per_rank  # the chunk's rest + the 2 steps made
            assert len(counting.docs) <= bound < (k + m) * per_rank


def test_a_streams_skipped_rows_are_counted_alike_after_a_resume(
    tmp_path, tok, write_shards, train_loader
):
    """dataset_max_bad_rows on 2 dp ranks' streams: each rank counts the bad rows of its own
    share (2 files, 3 bad lines each) as it reads them, a resume at step 5 gives the same
    batches and counts at every step after it, and the next epoch counts nothing again."""
    docs = write_shards(tmp_path, 4, 100)
    for f in sorted(tmp_path.glob("*.jsonl")):
        lines = f.read_text().splitlines(keepends=True)
        for i in (10, 40, 70):
            lines.insert(i, '{"text": "cut\n')
        f.write_text("".join(lines))
    cfg, k, m, dp = stream_cfg(tmp_path, packing=False, dataset_max_bad_rows=6), 5, 70, 2
    for r in range(dp):
        counting = CountingTokenizer(tok)
        run = train_loader(cfg, counting, r, dp)
        steps = [(run.next_step(), run.skipped_rows()) for _ in range(k + m)]
        run.close()
        share = docs[100 * r : 100 * r + 100] + docs[200 + 100 * r : 300 + 100 * r]
        assert set(counting.docs) == set(share)  # the good rows of files r and r + 2
        counts = [c for _, c in steps]
        # 75 steps of 4 rows: one epoch of the share's 200 good rows and 6 bad ones, then half
        # of another, which meets the same bad rows without counting them again.
        assert counts == sorted(counts) and counts[0] > 0 and counts[-1] == 6
        ld = train_loader(cfg, tok, r, dp)
        for _ in range(k):
            ld.next_step()
        sd, stream = ld.state_dict(), ld.stream_state_dict()
        ld.close()
        ld = train_loader(cfg, tok, r, dp)
        ld.load_state_dict(sd, stream)
        for (batches, count), _ in zip(steps[k:], range(m)):
            assert all(torch.equal(x[0], y[0]) for x, y in zip(batches, ld.next_step()))
            assert ld.skipped_rows() == count
        ld.close()


def test_changed_dp_degree_is_refused_with_the_fix(tmp_path, tok, write_shards, train_loader):
    """A checkpoint of a sharded stream at dp degree 2 cannot resume at dp degree 1 (its
    per-rank positions would repeat or skip data); the error names both ways out."""
    write_shards(tmp_path / "data", 4, 20)
    cfg = stream_cfg(tmp_path / "data")

    def manager(dp_rank, dp):
        model = nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        ld = train_loader(cfg, tok, dp_rank, dp)
        ckpt = Checkpoint(enable=True, interval=1)
        state = TrainState()
        return CheckpointManager(ckpt, tmp_path, model, opt, sched, ld, state, dp_degree=dp)

    saver = manager(0, 2)
    saver.dataloader.next_step()
    saver.model(torch.ones(4)).sum().backward()
    saver.optimizer.step()
    saver.save(1)
    saver.close()
    saver.dataloader.close()
    same = manager(0, 2)
    assert same.load(plan_load(same.cfg, tmp_path)) == 1
    assert_nested_equal(same.dataloader.stream_state_dict(), saver.dataloader.stream_state_dict())
    other = manager(0, 1)
    with pytest.raises(ValueError, match="degree 2, this run has 1.*same data_parallel.*"
                       "exclude_from_loading dataloader"):  # fmt: skip
        other.load(plan_load(other.cfg, tmp_path))
    for m in (same, other):
        m.close()
        m.dataloader.close()


TINY = [
    *TINY_TRAIN,
    "--checkpoint.enable",
    "--checkpoint.interval", "5",
    "--training.steps", "8",
    "--training.dataset_streaming",
]  # fmt: skip


@pytest.mark.slow
def test_train_resumes_a_stream_exactly_and_refuses_another_dp_degree(
    tmp_path, write_shards, capsys
):
    """train.py on 2 dp ranks streaming 4 local files, checkpoint at step 5: a rerun from that
    checkpoint gives the uninterrupted run's losses for steps 6-8, bitwise; the same checkpoint
    under one process (dp degree 1) stops with the fix."""
    write_shards(tmp_path / "data", 4, 150)
    args = [*TINY, "--training.dataset_path", str(tmp_path / "data" / "*.jsonl")]
    ref, resumed, single = tmp_path / "ref", tmp_path / "resumed", tmp_path / "single"
    step5 = [str(out / "checkpoint" / "step-5") for out in (ref, resumed)]
    train_many([[*args, "--job.dump_folder", str(ref)], {"copy": step5},
                [*args, "--job.dump_folder", str(resumed)]], nproc=2)  # fmt: skip
    shutil.copytree(step5[0], single / "checkpoint" / "step-5")
    losses = {r["step"]: r["loss"] for r in read_jsonl(ref / "metrics.jsonl")}
    again = {r["step"]: r["loss"] for r in read_jsonl(resumed / "metrics.jsonl")}
    assert sorted(again) == [6, 7, 8] and again == {s: losses[s] for s in again}
    capsys.readouterr()
    assert train.main([*args, "--job.dump_folder", str(single)]) == 2
    err = capsys.readouterr().err
    assert "data-parallel degree 2, this run has 1" in err, err[-3000:]
    assert "exclude_from_loading dataloader" in err


@pytest.mark.parametrize("packing", [True, False])
def test_a_validation_stream_is_read_whole_in_order(data, store, tok, packing):
    """Every rank reads the whole stream once: the samples of the token store, in order."""
    stream = local_source(str(data), streaming=True).stream
    get, count = cached_samples(store, SEQ, packing)
    got = [s.tolist() for s in validation_samples(stream, tok, SEQ, packing)]
    assert got == [get(i).tolist() for i in range(count)]
