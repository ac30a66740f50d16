"""Qwen3 in the parity suite: real train.py runs of its debug flavor (torchrun, gloo, 2 ranks)
under FSDP 2 (also with selective AC), TP 2 (QK-norm's replicated weights over sequence-parallel
heads, loss parallel), PP 2 and CP 2 give one process's per-step losses and grad norms, within
the tolerances the Llama layouts are held to (test_parallel_numerics.py,
test_pipeline_numerics.py), each block's gradient norm too; FSDP 2 x TP 2 on 4 ranks; the tied
flavor with the chunked loss under FSDP 2."""

import pytest
from integration.parity import (
    BASE,
    CP,
    PP,
    assert_block_norms_match,
    assert_matches,
    curves,
    launch,
    one_microbatch,
)

pytestmark = pytest.mark.slow  # every test here launches processes

QWEN3 = [*BASE, "--model.name", "qwen3", "--model.flavor", "debugmodel"]
TIED = [*QWEN3, "--model.flavor", "debugmodel_tied", "--loss.chunk_tokens", "24"]
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]
# name: (ranks, args, the one-process run it must match, relative tolerance)
LAYOUTS = {
    "fsdp2": (2, [*QWEN3, *FSDP2], "reference", 1e-4),
    "tp2": (2, [*QWEN3, "--parallelism.tensor_parallel_degree", "2"], "reference", 1e-4),
    "pp2": (2, [*QWEN3, PP, "2"], "reference", 1e-5),
    # Context parallelism: Llama's CP layouts are held to 1e-5.
    "cp2": (2, [*QWEN3, CP, "2", *one_microbatch(1)], "reference", 1e-5),
    # Selective op AC recomputes the QK-norms inside the FSDP-wrapped blocks.
    "fsdp2_sac": (
        2,
        [*QWEN3, *FSDP2, "--activation_checkpoint.mode", "selective"],
        "reference",
        1e-4,
    ),
    "tied_fsdp2": (2, [*TIED, *FSDP2], "tied_reference", 1e-4),
    # The usual 2-D layout: the QK-norm weights replicated over TP, sharded over FSDP.
    "fsdp2xtp2": (
        4,
        [*QWEN3, *FSDP2, "--parallelism.tensor_parallel_degree", "2"],
        "reference",
        1e-4,
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    jobs = {
        "reference": (1, QWEN3),
        "tied_reference": (1, TIED),
        **{name: (n, args) for name, (n, args, _, _) in LAYOUTS.items()},
    }
    return launch(tmp_path_factory.mktemp("qwen3"), jobs)


@pytest.mark.parametrize("name", LAYOUTS)
def test_qwen3_layout_matches_one_process(runs, name):
    _, _, ref, rtol = LAYOUTS[name]
    assert_matches(name, curves(runs[name]), curves(runs[ref]), rtol)
    # Every block's gradient norm (its QK-norm weights' among them), not just the total's.
    assert_block_norms_match(name, runs[name], runs[ref], rtol)


def test_qwen3_learns(runs):
    losses = [loss for _, loss, _ in curves(runs["reference"])]
    assert losses[-1] < losses[0]
