"""Parallelism proven on CPU: real train.py runs (torchrun, gloo, 4 ranks) give the same per-step
losses and grad norms as one process, for every layout of FSDP, HSDP, TP and CP (pipeline layouts:
test_pipeline_numerics.py); bad layouts fail cleanly before any weight is built."""

import json
import re

import pytest
from conftest import REPO, run_train, torchrun_script
from integration.parity import (
    BASE,
    PP,
    SCHEDULE,
    assert_matches,
    assert_parity,
    curves,
    launch,
    masked_runs,
    one_microbatch,
)

pytestmark = pytest.mark.slow  # every test here launches processes


# name: (ranks, args, relative tolerance on every step's loss and grad norm).
LAYOUTS = {
    "fsdp4": (4, ["--parallelism.data_parallel_shard_degree", "4"], 1e-4),
    "hsdp2x2": (4, ["--parallelism.data_parallel_replicate_degree", "2"], 1e-4),
    # Gathered logits and a plain CE (loss parallel off), then loss parallel (on by default).
    "tp4": (4, [
        "--parallelism.tensor_parallel_degree", "4", "--parallelism.disable_loss_parallel",
        *one_microbatch(1),
    ], 1e-4),
    "fsdp2xtp2_loss_parallel": (4, [
        "--parallelism.data_parallel_shard_degree", "2",
        "--parallelism.tensor_parallel_degree", "2",
    ], 1e-4),
    # The chunked loss under TP: vocab-sharded chunks, max/sum-exp all-reduced over TP.
    "fsdp2xtp2_chunked_loss": (4, [
        "--parallelism.data_parallel_shard_degree", "2",
        "--parallelism.tensor_parallel_degree", "2",
        "--loss.chunk_tokens", "24", *one_microbatch(2),
    ], 1e-4),
    # Context parallelism (Llama 3's all-gathered K/V over load-balanced chunks): measured within
    # 2e-7 of one process (loss and grad norm, 8 fp32 steps), so held to 1e-5: a layout must
    # not be a numerical approximation of one process.
    "cp4": (4, ["--parallelism.context_parallel_degree", "4", *one_microbatch(1)], 1e-5),
    # torchtitan's ring rotation, by its flag: the all-gather runs, the same numbers.
    "cp4_alltoall": (4, [
        "--parallelism.context_parallel_degree", "4", *one_microbatch(1),
        "--parallelism.context_parallel_rotate_method", "alltoall",
    ], 1e-5),
    "cp2xfsdp2": (4, [
        "--parallelism.context_parallel_degree", "2",
        "--parallelism.data_parallel_shard_degree", "2", *one_microbatch(2),
    ], 1e-5),
    "cp2xtp2": (4, [
        "--parallelism.context_parallel_degree", "2",
        "--parallelism.tensor_parallel_degree", "2", *one_microbatch(1),
    ], 1e-5),
    }  # fmt: skip
# FSDP 2 x TP 2 starts from the seed checkpoint (test below): since the init is layout-invariant,
# that one 4-rank run also stands for the plain layout.
SEEDED = "fsdp2xtp2_loss_parallel"
FSDP2_TP2 = LAYOUTS[SEEDED][1][:4]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this file by name -> its dump folder: the one-process runs one after another
    in one process, then those of each world size in one torchrun launch (process start-up is
    most of a tiny run's time on 2 cores)."""
    out = tmp_path_factory.mktemp("runs")
    masked, short = masked_runs(out)
    bf16 = [*BASE, "--training.mixed_precision_param", "bfloat16", "--training.steps", "4"]
    load_seed = ["--checkpoint.initial_load_path", str(out / "seed" / "checkpoint" / "step-0")]
    # name: (ranks, args)
    jobs = {
        "reference": (1, BASE),
        "mask_one": (1, masked),
        "mask_causal": (1, short),
        "bf16_one": (1, bf16),
        "seed": (1, [*BASE, "--checkpoint.create_seed_checkpoint", "--checkpoint.enable"]),
        "seed_one": (1, [*BASE, *load_seed]),
        **{name: (n, [*BASE, *args, *(load_seed if name == SEEDED else [])])
           for name, (n, args, _) in LAYOUTS.items()},
        "mask_fsdp2xtp2": (4, [*masked, *FSDP2_TP2, "--activation_checkpoint.mode", "selective",
                               "--loss.chunk_tokens", "24"]),
        "mask_cp2xfsdp2": (4, [*masked, *LAYOUTS["cp2xfsdp2"][1][:4]]),
        "bf16_fsdp4": (4, [*bf16, *LAYOUTS["fsdp4"][1]]),
    }  # fmt: skip
    return launch(out, jobs)


@pytest.fixture(scope="module")
def reference(runs):
    return curves(runs["reference"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(layout, runs):
    assert_parity(layout, runs[layout], runs["reference"], rtol=LAYOUTS[layout][2])


def test_document_masking_fsdp_x_tp_matches_one_process(runs):
    """torchtitan's flavor name for document masking, under FSDP 2 x TP 2 with selective AC and
    the chunked loss, against one process with the same flavor, on documents of 3-20 tokens (so
    every 32-token row packs several); and the mask does change the losses."""
    got, ref = curves(runs["mask_fsdp2xtp2"]), curves(runs["mask_one"])
    assert_matches("document masking fsdp2xtp2 vs 1 process", got, ref, steps=4)
    # Same weights and data, causal mask only: measured 8e-4 off at step 1, 6e-3 at step 3.
    causal = curves(runs["mask_causal"])
    assert max(abs(c[1] / r[1] - 1) for c, r in zip(causal, ref)) > 1e-3, (causal, ref)


def test_document_masking_under_cp_matches_one_process(runs):
    """CP 2 x FSDP 2: each rank's two chunks of queries attend over the gathered keys with the
    mask of their own documents, which cross chunk and rank borders (3-20 token documents,
    32-token rows cut into 8-token chunks). Measured within 1.5e-7 of one process."""
    got, ref = curves(runs["mask_cp2xfsdp2"]), curves(runs["mask_one"])
    assert_matches("document masking cp2xfsdp2 vs 1 process", got, ref, rtol=1e-5, steps=4)


def test_bf16_fsdp_matches_one_process_bf16(runs):
    """bf16 is FSDP's policy in every layout (a one-rank mesh in one process), so one process and
    FSDP 4 round alike: measured 7e-8 apart at step 1, bitwise equal after, on an AVX2 CPU.

    Other CPUs may pick other bf16 kernels for 8 rows than for 2, flipping the last bf16 bit of a
    few activations; that is the kind of difference TP's bf16 partial sums make, measured at 8e-6
    (step 1) and 2e-5 (later steps) in tests/models/llama/test_parallelize.py, so the bounds are
    2.5x and 5x those. One process under autocast (the old mechanism) was 8.9e-5 / 1.5e-6 / 5.4e-5
    / 1.5e-4 off over the 4 steps and fails both."""
    got, ref = curves(runs["bf16_fsdp4"]), curves(runs["bf16_one"])
    assert [s for s, _, _ in got] == [s for s, _, _ in ref] == [1, 2, 3, 4]
    assert got[0][1] == pytest.approx(ref[0][1], rel=2e-5)  # the same weights
    for (_, loss, norm), (_, ref_loss, ref_norm) in zip(got, ref):
        assert loss == pytest.approx(ref_loss, rel=1e-4)
        assert norm == pytest.approx(ref_norm, rel=1e-4)


def test_seed_checkpoint_then_fsdp_x_tp(runs, reference):
    step0 = runs["seed"] / "checkpoint" / "step-0"
    assert (step0 / ".metadata").exists()
    assert not (runs["seed"] / "metrics.jsonl").exists()  # the seed run trains no step

    one_seeded, two_d = curves(runs["seed_one"]), curves(runs[SEEDED])
    assert_matches("fsdp2xtp2 from seed vs 1 process from seed", two_d, one_seeded)
    # Our init is layout-invariant, so starting from the seed changes nothing.
    assert_matches("1 process from seed vs plain", one_seeded, reference)
    assert_matches("fsdp2xtp2 from seed vs plain", two_d, reference)


@pytest.mark.parametrize(
    "nproc, args, expected",
    [
        (2, ["--parallelism.data_parallel_shard_degree", "4"], "but the world size is 2"),
        (3, ["--parallelism.tensor_parallel_degree", "3"], "must divide both n_heads (16)"),
        (
            2,
            ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "30"],
            "seq_len (30) must be divisible by 2 x context_parallel_degree (4)",
        ),
        (2, [PP, "2", SCHEDULE, "ZBVZeroBubble"], "ZBVZeroBubble over 4 stages needs at least 4"),
    ],
    ids=[
        "degrees_vs_world",
        "tp_vs_heads",
        "seq_len_vs_cp",
        "pp_microbatches",
    ],  # fmt: skip
)
def test_bad_layout_fails_cleanly_under_torchrun(nproc, args, expected, tmp_path):
    dump = tmp_path / "run"
    proc = run_train([*BASE, *args, "--job.dump_folder", str(dump)], nproc=nproc, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # Each rank that got that far prints the same one line (torchrun may SIGTERM the rest first).
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("titanlite: error:")]
    assert 1 <= len(errors) <= nproc and len(set(errors)) == 1, proc.stderr
    assert expected in errors[0]
    # The worker exits 2 (the config-error code); the only traceback is torchrun's own launcher
    # reporting the failed child, never a frame of train.py or titanlite.
    assert re.search(r"exitcode\s*:\s*2\b", proc.stderr), proc.stderr
    assert not re.search(r'File ".*(train\.py|titanlite)', out), out
    # Rejected before the model is built: no parameter count logged, nothing written.
    assert "parameters" not in out
    assert not dump.exists()


def test_a_user_error_on_one_rank_only_is_said_by_that_rank(tmp_path):
    """A data file missing on one node only: that rank stops with the one line naming it (its
    peers, past the check, wait in a collective until they are stopped), whichever rank it is:
    a line left to rank 0 would never be written."""
    missing = tmp_path / "nowhere.jsonl"
    extra = json.dumps(["--training.dataset", "local", "--training.dataset_path", str(missing)])
    args = [*BASE, "--parallelism.data_parallel_shard_degree", "2"]
    proc = torchrun_script(REPO / "tests" / "integration" / "one_rank_args.py", "1", extra,
                           *args, "--job.dump_folder", str(tmp_path / "run"), nproc=2,
                           check=False)  # fmt: skip
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("titanlite: error:")]
    assert len(errors) == 1 and str(missing) in errors[0], proc.stderr
