"""A weighted mixture of named sources: the blend's shares, its independence of the dp split,
its resume at another dp degree, exhausted sources, and the one-line errors."""

import numpy as np
import pytest
import torch

from tests.data.conftest import ragged_docs
from titanlite.checks import check_options
from titanlite.config import ConfigError, DataLoader, MixtureSource, MixtureStage, Training
from titanlite.config_parse import parse_args
from titanlite.data.mixture import MixtureOrder, Part
from titanlite.data.order import PermutedOrder, microbatch_rows

SEQ, G = 16, 8
WEIGHTS = {"web": 0.6, "code": 0.25, "math": 0.15}


def blend(weights, sizes=None, exhausted="repeat"):
    sizes = sizes or [10**6] * len(weights)
    parts = [
        Part(str(k), w, PermutedOrder(lambda i: i, 0, n, seed=k), 0)
        for k, (w, n) in enumerate(zip(weights, sizes, strict=True))
    ]
    return MixtureOrder(parts, exhausted)


@pytest.mark.parametrize("weights", [[0.6, 0.25, 0.15], [0.5, 0.5], [0.01, 0.3, 0.69], [1.0]])
def test_every_prefix_holds_each_share_within_one_sequence(weights):
    n = 3000
    sources = blend(weights).sources(0, n)
    counts = np.stack([np.cumsum(sources == k) for k in range(len(weights))], axis=1)
    expected = np.arange(1, n + 1)[:, None] * np.array(weights)[None, :]
    assert np.abs(counts - expected).max() < 1


def test_positions_are_a_function_of_the_position_alone():
    """Read in pieces, backwards, or by a fresh walker: the same sources (any dp rank's rows)."""
    whole = blend([0.6, 0.25, 0.15]).sources(0, 500)
    walker = blend([0.6, 0.25, 0.15])
    pieces = [walker.sources(a, a + 50) for a in range(450, -1, -50)][::-1]
    assert np.array_equal(np.concatenate(pieces), whole)
    assert walker.counts_at(500) == [int((whole == k).sum()) for k in range(3)]


def test_an_exhausted_source_repeats_with_a_log_line_or_stops(caplog):
    caplog.set_level("INFO", logger="titanlite.data.mixture")
    small = blend([0.5, 0.5], sizes=[1000, 7])
    small.take(0, 40)  # source 1 holds 20 of these: its epochs 1 and 2 begin
    said = [r.getMessage() for r in caplog.records]
    assert any("'1': epoch 1 of its 7 samples begins at blend position 15" in m for m in said)
    assert any("epoch 2 of its 7" in m for m in said)
    with pytest.raises(ConfigError, match=r"'1' ran out of its 7 samples at blend position 15"):
        blend([0.5, 0.5], sizes=[1000, 7], exhausted="stop").take(0, 40)


@pytest.fixture
def sources(tmp_path, write_jsonl):
    rng = np.random.default_rng(1)
    return [
        MixtureSource(
            name, str(write_jsonl(tmp_path / f"{name}.jsonl", ragged_docs(rng, 60, 30, name))), w
        )
        for name, w in WEIGHTS.items()
    ]


def mcfg(sources, tmp_path, **kw):
    return Training(
        mixture=sources, seq_len=SEQ, local_batch_size=8, global_batch_size=G,
        data_cache_dir=str(tmp_path / "cache"), **kw,
    )  # fmt: skip


def test_the_loader_blends_by_weight_the_same_for_every_dp_split(
    sources, tmp_path, tok, global_steps, train_loader, caplog
):
    caplog.set_level("INFO", logger="titanlite.data.loader")
    cfg = mcfg(sources, tmp_path)
    ref = global_steps(cfg, tok, 1, 8, steps=6)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training data")]
    assert lines[0] == "training data: 3 sources, blended by weight"
    assert (
        "web, weight 0.6: local-web: 1 json file (web.jsonl)" in lines[1]
        and "math, weight 0.15" in lines[3]
    )
    for dp, local in [(2, 2), (4, 1)]:
        got = global_steps(cfg, tok, dp, local, steps=6)
        assert all(
            torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            for a, b in zip(ref, got, strict=True)
        )
    ld = train_loader(cfg, tok)
    counts = np.bincount(ld.order.sources(0, 6 * G), minlength=3)
    assert np.abs(counts / (6 * G) - list(WEIGHTS.values())).max() < 1 / (6 * G) + 1e-9
    for _ in range(6):
        ld.next_step()
    seen = ld.source_tokens()  # the steps consumed, not the one the thread prefetched
    assert seen == {f"tokens_seen/{n}": int(c) * SEQ for n, c in zip(WEIGHTS, counts, strict=True)}
    ld.close()


@pytest.mark.parametrize("resume_dp", [1, 2])
def test_resume_at_another_dp_degree_continues_the_blend(
    sources, tmp_path, tok, resume_dp, rank_loaders, next_global_steps, global_steps
):
    cfg = mcfg(sources, tmp_path)
    ref = global_steps(cfg, tok, 2, 2, steps=5)
    first = rank_loaders(cfg, tok, 2, 2)
    next_global_steps(first, 3)
    sd = first[0].state_dict()
    assert sd["mixture"] == "from step 1: web=0.6,code=0.25,math=0.15"
    walk = sd["mixture_walk"]  # the blend's counts at the step: a resume starts its walk there
    assert walk["position"] == 3 * G and sum(walk["counts"]) == 3 * G
    for ld in first:
        ld.close()
    resumed = rank_loaders(cfg, tok, resume_dp, 8 // (2 * resume_dp))
    for ld in resumed:
        ld.load_state_dict(sd)
        assert ld.order._pos == 3 * G  # not walked from 0
    got = next_global_steps(resumed, 2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(ref[3:], got, strict=True))
    other = mcfg([*sources[:2], MixtureSource("math", sources[2].dataset_path, 0.5)], tmp_path)
    with pytest.raises(ConfigError, match="mixture: checkpoint"):
        rank_loaders(other, tok, 1, 8)[0].load_state_dict(sd)
    for ld in resumed:
        ld.close()


@pytest.mark.parametrize(
    "tables, error",
    [
        ('name = "a"\ndataset_path = "x"\nweight = 0.0', "'a' has weight 0.0: weights must be > 0"),
        ('name = "a"\ndataset_path = "x"\nweight = -1', "weights must be > 0"),
        (
            'name = "a"\ndataset_path = "x"\nweight = 1\n[[training.mixture]]\nname = "a"\n'
            'dataset_path = "y"\nweight = 1',
            r"names \['a'\] more than once",
        ),
        ('dataset_path = "x"\nweight = 1', "needs a name"),
        ('name = "a"\nweight = 1', "'a' needs a dataset_path"),
        ('name = "a"\ndataset_path = "x"\nwieght = 1', "unknown key 'wieght'; did you mean weight"),
        ('name = "a"\ndataset_path = "x"\nweight = "high"', "weight expects a float"),
        ('name = "a/b"\ndataset_path = "x"\nweight = 1', "name 'a/b' would collide in the"),
        ('name = "global"\ndataset_path = "x"\nweight = 1', "neither 'global' nor 'validation'"),
    ],
)
def test_bad_mixtures_are_one_line_before_any_work(tmp_path, tables, error):
    path = tmp_path / "mix.toml"
    path.write_text(f"[[training.mixture]]\n{tables}\n")
    with pytest.raises(ConfigError, match=error):
        check_options(parse_args(["--job.config_file", str(path)]))
    with pytest.raises(ConfigError, match=r"list of tables: write \[\[training.mixture\]\]"):
        parse_args(["--training.mixture", "x"])


def test_a_stage_switches_exactly_and_holds_its_own_shares():
    """From position 600 on, the anneal mix: each stage's shares within one sequence from its
    own first position, and every source continues its own order across the switch."""
    walker = blend([0.6, 0.25, 0.15])
    walker.stages.append((600, [0.2, 0.0, 0.8]))
    sources, within = walker._walk(0, 1500)
    for lo, hi, weights in [(0, 600, [0.6, 0.25, 0.15]), (600, 1500, [0.2, 0.0, 0.8])]:
        part = sources[lo:hi]
        counts = np.stack([np.cumsum(part == k) for k in range(3)], axis=1)
        expected = np.arange(1, hi - lo + 1)[:, None] * np.array(weights)[None, :]
        assert np.abs(counts - expected).max() < 1
    for k in range(3):
        assert np.array_equal(within[sources == k], np.arange((sources == k).sum()))


def stage_cfg(sources, tmp_path, from_step=4):
    cfg = mcfg(sources, tmp_path)
    cfg.mixture_stage = [MixtureStage(from_step, ["web=0.2", "math=0.8"])]
    return cfg


@pytest.mark.parametrize("stop_at", [2, 4])
def test_resume_across_the_stage_switch(
    sources, tmp_path, tok, stop_at, rank_loaders, next_global_steps, global_steps, train_loader
):
    cfg = stage_cfg(sources, tmp_path)
    ref = global_steps(cfg, tok, 1, 8, steps=6)
    ld = train_loader(cfg, tok)
    sources_by_step = ld.order.sources(0, 6 * G).reshape(6, G)
    ld.close()
    assert 1 not in sources_by_step[3:]  # code is off from (logged) step 4 on, exactly
    assert (sources_by_step[2] == 1).any()
    first = rank_loaders(cfg, tok, 2, 2)
    next_global_steps(first, stop_at)
    sd = first[0].state_dict()
    for ld in first:
        ld.close()
    resumed = rank_loaders(cfg, tok, 4, 1)
    for ld in resumed:
        ld.load_state_dict(sd)
    got = next_global_steps(resumed, 6 - stop_at)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(ref[stop_at:], got, strict=True))
    for ld in resumed:
        ld.close()
    with pytest.raises(ConfigError, match="mixture: checkpoint"):
        rank_loaders(stage_cfg(sources, tmp_path, 5), tok, 1, 8)[0].load_state_dict(sd)


@pytest.mark.parametrize(
    "stages, error",
    [
        ('from_step = 5\nweights = ["web=1", "wiki=1"]', r"names \['wiki'\], which no"),
        ('from_step = 5\nweights = ["web:1"]', "'web:1' is not name=weight"),
        ('from_step = 5\nweights = ["web=0"]', "weights must be >= 0 and not all 0"),
        ('from_step = 0\nweights = ["web=1"]', "from_step 0 must be after the previous"),
    ],
)
def test_bad_stages_are_one_line(tmp_path, stages, error):
    path = tmp_path / "mix.toml"
    path.write_text(
        '[[training.mixture]]\nname = "web"\ndataset_path = "x"\nweight = 1\n'
        f"[[training.mixture_stage]]\n{stages}\n"
    )
    with pytest.raises(ConfigError, match=error):
        check_options(parse_args(["--job.config_file", str(path)]))


def test_worker_processes_make_the_same_blend(sources, tmp_path, tok, global_steps):
    """training.dataloader.num_workers > 0: each worker walks the blend in its own copy."""
    ref = global_steps(mcfg(sources, tmp_path), tok, 1, 4, steps=3)
    cfg = mcfg(sources, tmp_path, dataloader=DataLoader(num_workers=2))
    got = global_steps(cfg, tok, 1, 4, steps=3)
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(ref, got, strict=True)
    )


def test_each_rows_source_is_the_blends(sources, tmp_path, tok, train_loader):
    """step_sources (loss/<name>): the source of each row of this rank's microbatches of the
    step just taken, as the blend placed it: the source whose samples that row holds."""
    cfg = mcfg(sources, tmp_path)
    cfg.local_batch_size = 2  # dp rank 1 of 2: 2 microbatches of 2 rows
    ld = train_loader(cfg, tok, 1, 2)
    bases = [p.base for p in ld.order.parts]
    seen = set()
    try:
        assert ld.source_names() == list(WEIGHTS)
        for step in range(4):
            ld.next_step()
            for i, got in enumerate(ld.step_sources()):
                rows = microbatch_rows(
                    step, i, 1, dp_degree=2, num_microbatches=2, local_batch_size=2
                )
                owner = np.searchsorted(bases, ld.order.samples(*rows), side="right") - 1
                assert got.tolist() == owner.tolist()
                seen.update(got.tolist())
    finally:
        ld.close()
    assert seen == {0, 1, 2}
