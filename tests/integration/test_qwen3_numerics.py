"""Qwen3 in the parity suite: real train.py runs of its debug flavor (torchrun, gloo, 2 ranks)
under FSDP 2 (also with selective AC), TP 2 (QK-norm's replicated weights over sequence-parallel
heads, loss parallel), PP 2 and CP 2 give one process's per-step losses and grad norms, within
the tolerances the Llama layouts are held to (test_parallel_numerics.py,
test_pipeline_numerics.py), each block's gradient norm too; so do compiled blocks, HSDP 2, and
FSDP 2 x TP 2 on 4 ranks; the tied flavor with the chunked loss under FSDP 2, TP 2 and PP 2;
document masking under CP 2 and PP 2."""

import pytest
from integration.parity import (
    BASE,
    CP,
    PP,
    assert_matches,
    assert_parity,
    curves,
    launch,
    masked_runs,
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
    # Compiled blocks (QK-norm inside each graph) and loss; aot_eager spares inductor's C++
    # build: dynamo's trace and AOTAutograd's graphs are the backend-independent part.
    "compiled": (
        1,
        [*QWEN3, "--compile.enable", "--compile.backend", "aot_eager"],
        "reference",
        1e-5,
    ),
    "hsdp2": (2, [*QWEN3, "--parallelism.data_parallel_replicate_degree", "2"], "reference", 1e-4),
    "tied_fsdp2": (2, [*TIED, *FSDP2], "tied_reference", 1e-4),
    # The tied weight one vocab-sharded DTensor for the lookup and the output; under PP a copy
    # on the last stage whose gradient is summed with the first stage's.
    "tied_tp2": (2, [*TIED, "--parallelism.tensor_parallel_degree", "2"], "tied_reference", 1e-5),
    "tied_pp2": (2, [*TIED, PP, "2"], "tied_reference", 1e-5),
    # The usual 2-D layout: the QK-norm weights replicated over TP, sharded over FSDP.
    "fsdp2xtp2": (
        4,
        [*QWEN3, *FSDP2, "--parallelism.tensor_parallel_degree", "2"],
        "reference",
        1e-4,
    ),
}


# Document masking on short ragged documents (4 steps): each layout against one process.
MASKED = {"mask_cp2": (2, [CP, "2", *one_microbatch(1)]), "mask_pp2": (2, [PP, "2"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3")
    _, short = masked_runs(out)
    causal = [*short, "--model.name", "qwen3", "--model.flavor", "debugmodel"]
    masked = [*causal, "--model.document_masking"]
    jobs = {
        "reference": (1, QWEN3),
        "tied_reference": (1, TIED),
        "mask_reference": (1, masked),
        "mask_causal": (1, causal),
        **{name: (n, args) for name, (n, args, _, _) in LAYOUTS.items()},
        **{name: (n, [*masked, *args]) for name, (n, args) in MASKED.items()},
    }
    return launch(out, jobs)


@pytest.mark.parametrize("name", LAYOUTS)
def test_qwen3_layout_matches_one_process(runs, name):
    _, _, ref, rtol = LAYOUTS[name]
    # Every block's gradient norm (its QK-norm weights' among them) too, not just the total's.
    assert_parity(name, runs[name], runs[ref], rtol)


@pytest.mark.parametrize("name", MASKED)
def test_qwen3_with_document_masking_matches_one_process(runs, name):
    got, ref = curves(runs[name]), curves(runs["mask_reference"])
    assert_matches(name, got, ref, rtol=1e-5, steps=4)


def test_document_masking_changes_the_losses(runs):
    """The masks are applied: on the same documents the plain causal run's losses differ."""
    masked, causal = curves(runs["mask_reference"]), curves(runs["mask_causal"])
    assert max(abs(m[1] / c[1] - 1) for m, c in zip(masked, causal)) > 1e-3, (masked, causal)


def test_qwen3_learns(runs):
    losses = [loss for _, loss, _ in curves(runs["reference"])]
    assert losses[-1] < losses[0]
