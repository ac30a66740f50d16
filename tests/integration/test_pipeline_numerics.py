"""Pipeline parallelism proven on CPU: real train.py runs (torchrun, gloo, 2 or 4 ranks) with
every schedule, and PP with FSDP, HSDP and TP, give the same per-step losses and grad norms as one
process (held to 1e-5; the other layouts are test_parallel_numerics.py's)."""

import pytest
from integration.parity import BASE, assert_block_norms_match, assert_matches, curves, launch

pytestmark = pytest.mark.slow  # every test here launches processes

PP, SCHEDULE = "--parallelism.pipeline_parallel_degree", "--parallelism.pipeline_parallel_schedule"
FOUR_ROWS = ["--training.local_batch_size", "4"]  # multi-stage schedules: 4 stages, 4 microbatches
# name: (ranks, args, relative tolerance on every step's loss and grad norm). Every schedule on
# the debug model's 6 layers with the default split (PP 2: two stages of 3 layers, or four of 1-2
# for multi-stage schedules), then PP with the other dims. Measured within 1.6e-7 of one process.
LAYOUTS = {
    "pp2_1f1b": (2, [PP, "2"], 1e-5),
    "pp2_gpipe": (2, [PP, "2", SCHEDULE, "GPipe"], 1e-5),
    **{
        f"pp2_{name.lower()}": (2, [PP, "2", SCHEDULE, name, *FOUR_ROWS], 1e-5)
        for name in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                     "DualPipeV")
    },
    "pp4_1f1b": (4, [PP, "4", *FOUR_ROWS], 1e-5),
    "pp2_fsdp2": (4, [PP, "2", "--parallelism.data_parallel_shard_degree", "2"], 1e-5),
    "pp2_fsdp2_zbv": (4, [PP, "2", SCHEDULE, "ZBVZeroBubble", *FOUR_ROWS], 1e-5),
    "pp2_replicate2": (4, [PP, "2", "--parallelism.data_parallel_replicate_degree", "2"], 1e-5),
    # The last stage computes the loss on vocab-sharded, chunked logits.
    "pp2_tp2_loss_parallel": (4, [
        PP, "2", "--parallelism.tensor_parallel_degree", "2", "--loss.chunk_tokens", "24",
    ], 1e-5),
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The one-process reference and every layout, by name -> dump folder."""
    jobs = {"reference": (1, BASE)}
    jobs |= {name: (n, [*BASE, *args]) for name, (n, args, _) in LAYOUTS.items()}
    return launch(tmp_path_factory.mktemp("runs"), jobs)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(layout, runs):
    rtol = LAYOUTS[layout][2]
    got, ref = curves(runs[layout]), curves(runs["reference"])
    assert_matches(f"{layout} vs 1 process", got, ref, rtol=rtol)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_block_grad_norms_match_one_process(layout, runs):
    """metrics.log_layer_grad_norms: each stage measures its own blocks, and the logging rank
    (first stage) lists every block."""
    assert_block_norms_match(layout, runs[layout], runs["reference"], rtol=LAYOUTS[layout][2])
