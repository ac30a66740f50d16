"""The search: layouts checked as training checks them, ranked, written as train.py options;
progress lines on a terminal when asked."""

import functools

import pytest
from conftest import Terminal

import titanlite.plan.search
from titanlite.config_parse import parse_args
from titanlite.job import World, resolve_job
from titanlite.plan.devices import get_device
from titanlite.plan.perf import Constants, Layout
from titanlite.plan.search import Choices, Cluster, flags, memory_gib, search, smallest_cluster
from titanlite.plan.shape import LLAMA3_VOCAB, layout_of, model_of
from titanlite.progress import Progress

H100 = get_device("h100-sxm")


def model(flavor: str, seq_len: int = 8192, *extra: str):
    cfg = parse_args(["--job.config_file", "train_configs/llama_8b.toml",
                      "--model.flavor", flavor, *extra])  # fmt: skip
    return model_of(cfg, LLAMA3_VOCAB, seq_len)


def speed(c) -> float:
    """A candidate's predicted tokens/s per GPU as the ranking compares them."""
    return titanlite.plan.search.tied(c.prediction.tokens_per_s_per_gpu)


def test_8b_on_a_node_ranked_fastest_first_and_every_row_fits():
    plan = search(model("8B"), Cluster(8, 8, H100), 16, Constants())
    speeds = [speed(c) for c in plan.fits]
    assert plan.fits and speeds == sorted(speeds, reverse=True)
    assert all(c.memory_gib <= H100.memory_gib - 3 for c in plan.fits)
    assert all(c.layout.world == 8 and c.layout.global_batch == 16 for c in plan.fits)
    assert plan.rejected["out of memory"] > 0  # no AC with the plain loss at 2 x 8192 does not fit


def test_equally_fast_layouts_rank_the_fewest_microbatches_first():
    # One GPU, no FSDP traffic: the model predicts every split of 8 rows alike, and each extra
    # microbatch would only add the host time it does not count.
    plan = search(model("1B", 2048), Cluster(1, 1, H100), 8, Constants())
    alike = [c for c in plan.fits if speed(c) == speed(plan.fits[0])]
    passes = [c.prediction.terms["microbatches"] for c in alike]
    assert len(set(passes)) > 1 and passes == sorted(passes)
    assert plan.fits[0].layout.local_batch_size == 8 and plan.fits[0].layout.accumulation == 1


def test_rejections_name_their_reasons():
    plan = search(model("8B"), Cluster(16, 8, H100), 6, Constants())
    why = plan.rejected
    assert why["TP does not divide the heads"] == 0  # 8B has 8 kv heads: tp 1-8 all divide
    assert why["global batch not divisible by the data-parallel degree"] > 0  # 6 over dp 4, 8, 16
    assert any(c.layout.cp > 1 and c.layout.pp > 1 for c in plan.fits)  # every dim composes
    odd = search(model("8B", 8190), Cluster(8, 8, H100), 8, Constants())
    assert odd.rejected["CP does not divide the sequence"] > 0
    assert all(c.layout.cp == 1 for c in odd.fits)


def test_a_layout_that_needs_more_microbatches_than_it_has_is_rejected():
    plan = search(model("8B"), Cluster(8, 8, H100), 1, Constants(), Choices(ac=("full",)))
    assert plan.rejected["too few microbatches for the schedule"] > 0
    assert not any(c.layout.pp > 1 for c in plan.fits)


def test_float8_only_where_the_device_has_it():
    a100 = get_device("a100-80gb")
    plan = search(model("1B"), Cluster(8, 8, a100), 8, Constants())
    assert plan.fits and not any(c.layout.float8 for c in plan.fits)


def test_405b_fits_no_node_and_the_smallest_cluster_is_named():
    m = model("405B")
    assert not search(m, Cluster(8, 8, H100), 8, Constants()).fits
    need = smallest_cluster(m, Cluster(8, 8, H100), 8, Constants())
    assert need in (64, 128, 256)  # 405 B params x 16 bytes over 80 GiB GPUs: at least 76
    assert search(m, Cluster(need, 8, H100), need, Constants(), Choices(
        ac=("full",), chunk_tokens=(2048,), float8=(False,))).fits  # fmt: skip


@pytest.mark.parametrize("lo", [
    Layout(tp=2, dp_shard=4, local_batch_size=2, accumulation=2, ac="full", chunk_tokens=2048),
    Layout(pp=2, dp_replicate=2, dp_shard=2, schedule="Interleaved1F1B", local_batch_size=4,
           ac="none", float8=True, compile=False),
    Layout(cp=2, dp_shard=4, ac="selective"),
    Layout(dp_shard=8, ac="selective_alternate"),
])  # fmt: skip
def test_flags_are_the_layout_as_train_py_reads_it(lo):
    cfg = parse_args(["--job.config_file", "train_configs/llama_8b.toml", *flags(lo)])
    assert layout_of(resolve_job(cfg, World(lo.world), LLAMA3_VOCAB)) == lo


def test_memory_of_the_fullest_pipeline_rank():
    m = model("8B")
    one = memory_gib(m, Layout(dp_shard=8, ac="full", chunk_tokens=2048))
    pp = memory_gib(m, Layout(pp=2, dp_shard=4, local_batch_size=2, ac="full", chunk_tokens=2048))
    assert 0 < one < pp  # half the blocks, but unsharded under PP and 2 microbatches in flight


@pytest.mark.parametrize("progress", [True, False])
def test_progress_lines_count_the_layouts_weighed_when_asked(monkeypatch, progress):
    """plan's command line asks; plan auto, which every rank of a job runs, does not."""
    terminal = Terminal()
    monkeypatch.setattr(titanlite.plan.search, "Progress",
                        functools.partial(Progress, stream=terminal, every_s=0))  # fmt: skip
    plan = search(model("8B"), Cluster(8, 8, H100), 16, Constants(), progress=progress)
    lines = terminal.getvalue().splitlines()
    if not progress:
        assert lines == []
        return
    total = int(lines[0].split(" of ")[1].split()[0].replace(",", ""))
    assert total >= len(plan.fits) + plan.rejected["out of memory"] and len(lines) == total
    assert lines[0].startswith(f"plan: search on 8 GPUs: 1 of {total:,} layouts (0%), ")
    assert lines[-1].startswith(f"plan: search on 8 GPUs: {total:,} of {total:,} layouts (100%)")
    assert lines[-1].endswith(" layouts/s, 00:00:00 left")
