"""Pipeline parallelism proven on CPU: real train.py runs (torchrun, gloo, 2, 4 or 8 ranks) with
every schedule, and PP with FSDP, HSDP, TP and CP, with and without document masking, give the
same per-step losses, grad norms and validation losses as one process (held to 1e-5; the other
layouts are test_parallel_numerics.py's)."""

import pytest
from conftest import read_jsonl, write_torch_schedule
from integration.parity import (
    BASE,
    CP,
    PP,
    PP_WHOLE_BATCH,
    SCHEDULE,
    assert_matches,
    assert_parity,
    curves,
    launch,
    masked_runs,
)

pytestmark = pytest.mark.slow  # every test here launches processes

# All 6 blocks of the debug model (the tiny run has 4), so that stages split unevenly.
SIX_LAYERS = [*BASE, "--model.flavor", "debugmodel"]
FOUR_ROWS = ["--training.local_batch_size", "4"]  # multi-stage schedules: 4 stages, 4 microbatches
# Stands for the schedule file the fixture writes: torch's Interleaved1F1B order for PP 2, four
# stages (layers_per_stage 2: the split Interleaved1F1B gets) and four microbatches, run by
# torch's _PipelineScheduleRuntime under the default schedule name (1F1B, one stage a rank).
SCHEDULE_FILE = "{schedule.csv}"
CSV = "--parallelism.pipeline_parallel_schedule_csv"
# A one-stage-a-rank file for PP 2 and four microbatches: rank 0 runs every forward first, rank 1
# a backward after each forward.
SINGLE_FILE = "{single.csv}"
SINGLE_CSV = "0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n"
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
    "pp2_csv": (2, [PP, "2", CSV, SCHEDULE_FILE,
                    "--parallelism.pipeline_parallel_layers_per_stage", "2", *FOUR_ROWS], 1e-5),
    # torchtitan's spelling (its pp_custom_csv case): the file's run named by torch's base class
    # of multi-stage schedules, which places two stages a rank; or of one-stage ones.
    "pp2_csv_multi": (2, [PP, "2", SCHEDULE, "PipelineScheduleMulti", CSV, SCHEDULE_FILE,
                          *FOUR_ROWS], 1e-5),
    "pp2_csv_single": (2, [PP, "2", SCHEDULE, "PipelineScheduleSingle", CSV, SINGLE_FILE,
                           *FOUR_ROWS], 1e-5),
    "pp4_1f1b": (4, [PP, "4", *FOUR_ROWS], 1e-5),
    "pp2_fsdp2": (4, [PP, "2", "--parallelism.data_parallel_shard_degree", "2"], 1e-5),
    "pp2_fsdp2_zbv": (4, [PP, "2", SCHEDULE, "ZBVZeroBubble", *FOUR_ROWS], 1e-5),
    "pp2_replicate2": (4, [PP, "2", "--parallelism.data_parallel_replicate_degree", "2"], 1e-5),
    # The last stage computes the loss on vocab-sharded, chunked logits.
    "pp2_tp2_loss_parallel": (4, [
        PP, "2", "--parallelism.tensor_parallel_degree", "2", "--loss.chunk_tokens", "24",
        *PP_WHOLE_BATCH,
    ], 1e-5),
    # Later stages are given this rank's chunks of hidden states; labels and positions are split
    # on every stage.
    "pp2_cp2": (4, [PP, "2", CP, "2", *PP_WHOLE_BATCH], 1e-5),
}  # fmt: skip
# Document masking under PP and CP, on short ragged documents, with validation every 2 steps:
# every stage builds its mask from the microbatch's document ids (not its hidden states).
# tp2_cp2_pp2 is torchtitan's validation_tp_cp_pp case with its flags (8 ranks).
MASKED = {
    "mask_pp2": (2, [PP, "2"]),
    "mask_pp2_cp2": (4, [PP, "2", CP, "2"]),
    "mask_pp2_cp2_zbv": (4, [PP, "2", CP, "2", SCHEDULE, "ZBVZeroBubble", *FOUR_ROWS]),
    "mask_tp2_cp2_pp2": (8, [
        "--parallelism.tensor_parallel_degree=2", "--parallelism.context_parallel_degree=2",
        "--parallelism.pipeline_parallel_degree=2",
        "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", *PP_WHOLE_BATCH,
    ]),
}  # fmt: skip
VALIDATION = ["--validation.enable", "--validation.freq", "2", "--validation.holdout_fraction",
              "0.05"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The one-process reference and every layout, by name -> dump folder."""
    out = tmp_path_factory.mktemp("runs")
    files = {
        SCHEDULE_FILE: str(write_torch_schedule(out / "schedule.csv", "Interleaved1F1B", 2, 4, 4)),
        SINGLE_FILE: str(out / "single.csv"),
    }
    (out / "single.csv").write_text(SINGLE_CSV)
    masked = [*masked_runs(out, "debugmodel")[0], *VALIDATION]
    jobs = {"reference": (1, SIX_LAYERS), "mask_one": (1, masked)}
    jobs |= {name: (n, [*SIX_LAYERS, *(files.get(a, a) for a in args)])
             for name, (n, args, _) in LAYOUTS.items()}  # fmt: skip
    jobs |= {name: (n, [*masked, *args]) for name, (n, args) in MASKED.items()}
    return launch(out, jobs)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(layout, runs):
    """Also metrics.log_layer_grad_norms: each stage measures its own blocks, and the logging
    rank (first stage) lists every block."""
    assert_parity(layout, runs[layout], runs["reference"], rtol=LAYOUTS[layout][2])


@pytest.mark.parametrize("layout", list(MASKED))
def test_document_masking_matches_one_process(layout, runs):
    """Training losses and grad norms, and the validation losses at steps 2 and 4 (the schedule
    run forward only), within 1e-5 of one process's. Measured within 1.5e-7."""
    got, ref = curves(runs[layout]), curves(runs["mask_one"])
    assert_matches(f"{layout} vs 1 process", got, ref, rtol=1e-5, steps=4)
    val = [{r["step"]: r["val_loss"] for r in read_jsonl(runs[name] / "metrics.jsonl")
            if "val_loss" in r} for name in (layout, "mask_one")]  # fmt: skip
    assert sorted(val[0]) == sorted(val[1]) == [2, 4]
    worst = max(abs(val[0][s] / val[1][s] - 1) for s in val[1])
    print(f"{layout}: validation loss, worst relative deviation {worst:.2e}")
    assert worst <= 1e-5
