"""A schedule CSV is held to the pipeline plan before anything is built: each way a file can miss
is one ConfigError naming the file and the fix. (Runs: test_pipeline.py on one rank,
tests/integration/test_pipeline_numerics.py on two.)"""

from types import SimpleNamespace

import pytest
from conftest import write_torch_schedule

from titanlite.config import ConfigError
from titanlite.models.pipeline_plan import plan_pipeline

# torch's 1F1B on 2 ranks, 2 microbatches: the file a plain PP 2 run of the debug model fits.
ONE_F_ONE_B = "0F0,0F1,,0B0,,0B1\n,1F0,1B0,1F1,1B1\n"


def options(csv, schedule="1F1B", layers_per_stage=0):
    return SimpleNamespace(
        pipeline_parallel_schedule=schedule,
        pipeline_parallel_schedule_csv=str(csv),
        pipeline_parallel_layers_per_stage=layers_per_stage,
        pipeline_parallel_first_stage_less_layers=1,
        pipeline_parallel_last_stage_less_layers=1,
        pipeline_parallel_microbatch_size=1,
    )


def plan(tmp_path, text, local_batch_size=2, **kw):
    """The debug model's 6 layers on PP 2 with a schedule file holding `text`."""
    path = tmp_path / "schedule.csv"
    path.write_text(text)
    return plan_pipeline(6, 2, local_batch_size, options(path, **kw))


def test_a_file_that_fits_is_planned_with_it(tmp_path):
    p = plan(tmp_path, ONE_F_ONE_B)
    assert p.csv == str(tmp_path / "schedule.csv") and p.num_stages == 2 and p.microbatches == 2


def test_torchs_own_interleaved_order_fits_four_stages(tmp_path):
    """The named schedule no longer has to fit: 1F1B (the default) would refuse two stages a
    rank, the file runs them."""
    path = write_torch_schedule(tmp_path / "i1f1b.csv", "Interleaved1F1B", 2, 4, 4)
    p = plan_pipeline(6, 2, 4, options(path, layers_per_stage=2))
    assert p.num_stages == 4 and p.stage_ids(1, 2) == [1, 3] and p.microbatches == 4


@pytest.mark.parametrize(
    "text, kw, match",
    [
        ("0F0,0Fx\n,1F0\n", {}, r"row 1, cell 2 '0Fx' is not a compute action; write "
         r"\[stage\]\[F\|B\|I\|W\]\[microbatch\]"),
        ("0F0,0SEND_F0\n1F0\n", {}, "cell 2 '0SEND_F0' is not a compute action.*torch adds the "
         "sends and receives"),
        ("0F0,hello\n", {}, "row 1, cell 2 'hello' is not a compute action"),
        ("0F0,0F1,0B0,0B1\n", {}, "has 1 rows, but pipeline_parallel_degree is 2: write one row "
         "per pipeline rank"),
        (None, {}, r"runs 4 stages \(numbered \[0, 1, 2, 3\]\), but the plan has 2 \(1 per rank, "
         r"pipeline_parallel_layers_per_stage derived\): set parallelism.pipeline_parallel_"
         r"layers_per_stage 2"),
        ("1F0,1F1,1B0,1B1\n0F0,0F1,0B0,0B1\n", {}, r"row 1 runs stages \[1\], but pipeline rank 0 "
         r"holds stages \[0\]"),
        (ONE_F_ONE_B, {"local_batch_size": 4}, r"uses microbatches \[0, 1\], but a step here "
         "has 4"),
        ("0F0,0B1,0F1,0B0\n1F0,1B0,1F1,1B1\n", {}, "cannot run: Rank 0, step 1: Running Full "
         "Backward for stage 0, microbatch 1 without first running Forward"),
        ("0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n", {}, "cannot run: .*expected 2 total backwards"),
        # Each rank waits for the other: rank 0 for microbatch 0's backward, which rank 1 runs
        # only after microbatch 1's, whose forward rank 0 has not sent yet.
        ("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n", {}, "cannot run: Malformed compute schedule"),
    ],
)  # fmt: skip
def test_a_file_that_does_not_fit_names_itself_and_the_fix(tmp_path, text, kw, match):
    if text is None:  # a four-stage file on the default two-stage plan
        text = write_torch_schedule(tmp_path / "i.csv", "Interleaved1F1B", 2, 4, 2).read_text()
    with pytest.raises(ConfigError, match=match) as e:
        plan(tmp_path, text, **kw)
    assert str(e.value).startswith(f"parallelism.pipeline_parallel_schedule_csv {tmp_path}")
    assert "\n" not in str(e.value)


def test_a_missing_file_says_so(tmp_path):
    match = r"schedule_csv .*nope.csv cannot be read \(.*No such file.*\): give the path of a"
    with pytest.raises(ConfigError, match=match):
        plan_pipeline(6, 2, 2, options(tmp_path / "nope.csv"))
