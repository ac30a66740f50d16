"""Muon exact under every layout: real train.py runs (torchrun, gloo) with the Muon recipe and a
rule group, under FSDP 2, TP 2, PP 2, CP 2, FSDP 2 x TP 2 and HSDP 2 x 2, give the same per-step
losses and grad norms as one process, held to 1e-5 in fp32: each matrix is orthogonalized whole
whatever shards it (titanlite/optim/muon.py)."""

import pytest
from integration.parity import BASE, CP, PP, assert_matches, curves, launch, one_microbatch

pytestmark = pytest.mark.slow  # every test here launches processes

MUON = [*BASE, "--optimizer.name", "Muon", "--optimizer.groups", "kind=norm lr=1e-3"]
FSDP2, TP2 = (
    ["--parallelism.data_parallel_shard_degree", "2"],
    ["--parallelism.tensor_parallel_degree", "2"],
)
BF16_STATES = ["--optimizer.state_dtype", "bfloat16"]  # AdamW's moments, elementwise on shards
# name: (ranks, args)
LAYOUTS = {
    "fsdp2": (2, FSDP2),
    "tp2": (2, [*TP2, *one_microbatch(1)]),
    "pp2": (2, [PP, "2"]),
    "cp2": (2, [CP, "2", *one_microbatch(1)]),
    "fsdp2xtp2": (4, [*FSDP2, *TP2, *one_microbatch(2)]),
    "hsdp2x2": (4, ["--parallelism.data_parallel_replicate_degree", "2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    jobs = {"reference": (1, MUON), "adamw": (1, BASE), "bf16_states": (1, [*MUON, *BF16_STATES]),
            "fsdp2_bf16_states": (2, [*MUON, *BF16_STATES, *FSDP2])}  # fmt: skip
    jobs.update({name: (n, [*MUON, *args]) for name, (n, args) in LAYOUTS.items()})
    return launch(tmp_path_factory.mktemp("muon"), jobs)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_muon_layout_matches_one_process(layout, runs):
    assert_matches(f"Muon {layout} vs 1 process", curves(runs[layout]), curves(runs["reference"]),
                   rtol=1e-5)  # fmt: skip


def test_bf16_adamw_states_under_fsdp_match_one_process(runs):
    got, ref = curves(runs["fsdp2_bf16_states"]), curves(runs["bf16_states"])
    assert_matches("Muon + bf16 AdamW states, fsdp2 vs 1 process", got, ref, rtol=1e-5)


def test_muon_is_not_adamw(runs):
    """The same weights and data, another update: the losses part after the first step."""
    muon, adamw = curves(runs["reference"]), curves(runs["adamw"])
    assert muon[0][1] == pytest.approx(adamw[0][1], rel=1e-6)
    assert abs(muon[-1][1] / adamw[-1][1] - 1) > 1e-3, (muon, adamw)
