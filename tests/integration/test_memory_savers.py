"""Memory savers with torchtitan's names: optimizer.early_step_in_backward and
training.enable_cpu_offload train exactly as the run without them does, and what the early step
cannot do exactly is refused with one line before the model is built."""

import pytest
import torch
from conftest import TINY_TRAIN, read_jsonl, train_many
from torch.distributed.fsdp import FSDPModule

import train
from titanlite.config_parse import parse_args
from titanlite.distributed import init_distributed

# FSDP over 2 ranks, one microbatch each (global 8 = 4 x 2) and no clipping: what the early step
# needs; the CPU-offload run shares the reference.
FSDP2 = [*TINY_TRAIN, "--training.local_batch_size", "4", "--training.max_norm", "0"]
FSDP2 += ["--training.steps", "3"]


def curve(dump):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_jsonl(dump / "metrics.jsonl")]


SAVERS = {
    "reference": [],
    "early_step": ["--optimizer.early_step_in_backward"],
    "cpu_offload": ["--training.enable_cpu_offload"],
}


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    """Each saver's FSDP 2 run and the reference, one after another in one 2-rank launch."""
    out = tmp_path_factory.mktemp("savers")
    train_many([[*FSDP2, *extra, "--job.dump_folder", str(out / name)]
                for name, extra in SAVERS.items()], nproc=2)  # fmt: skip
    return {name: curve(out / name) for name in SAVERS}


@pytest.mark.slow
def test_early_step_in_backward_trains_as_the_step_after_backward(curves):
    """Bitwise losses: the same AdamW kernels on the same reduce-scattered gradients, one
    parameter at a time. The logged norm is summed by the hooks in another order (fp64 on CPU,
    read in fp32): equal within an fp32 rounding."""
    got, reference = curves["early_step"], curves["reference"]
    assert [s for s, _, _ in got] == [1, 2, 3]
    assert [loss for _, loss, _ in got] == [loss for _, loss, _ in reference]
    assert [n for _, _, n in got] == pytest.approx([n for _, _, n in reference], rel=1e-6)


@pytest.mark.slow
def test_cpu_offload_trains_as_without(curves):
    """On a CPU the offload moves nothing, but FSDP runs its offload path (CPU shards checked,
    host copies, the step on the host tensors): the same numbers, bitwise."""
    assert curves["cpu_offload"] == curves["reference"]


def test_cpu_offload_without_data_parallelism_shards_over_one_rank(tmp_path):
    """fp32 on one rank applies no FSDP, except to offload (as bf16 applies it to cast)."""
    argv = [*TINY_TRAIN, "--training.local_batch_size", "8", "--training.enable_cpu_offload"]
    cfg = parse_args([*argv, "--job.dump_folder", str(tmp_path)])
    trainer = train.Trainer(cfg, init_distributed(cpu_backend=True))  # as train.main does
    try:
        assert isinstance(trainer.model, FSDPModule)
        assert all(p.device.type == "cpu" for p in trainer.model.parameters())
        assert torch.isfinite(trainer.train_step().grad_norm)
    finally:
        trainer.close()


NO_CLIP = ["--training.max_norm", "0"]
REFUSED = {  # extra options -> the fix the one line gives
    "skip-nonfinite": ([*NO_CLIP, "--training.on_nonfinite", "skip"], "on_nonfinite stop"),
    "skip-loss-spike": ([*NO_CLIP, "--training.loss_spike_factor", "3",
                         "--training.on_loss_spike", "skip"], "on_loss_spike report"),
    # TINY_TRAIN on one process: 4 microbatches of 2 rows.
    "accumulation": (NO_CLIP, "4 microbatches per rank (gradient accumulation): set "
                              "--training.local_batch_size 8"),
}  # fmt: skip


@pytest.mark.parametrize("args, problem", REFUSED.values(), ids=REFUSED.keys())
def test_early_step_refusals_are_one_line_before_the_model(args, problem, tmp_path, capsys,
                                                          monkeypatch):  # fmt: skip
    def no_build(*a, **k):
        raise AssertionError("the model was built")

    monkeypatch.setattr(train, "build_model", no_build)
    argv = [*TINY_TRAIN, "--optimizer.early_step_in_backward", *args]
    assert train.main([*argv, "--job.dump_folder", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("titanlite: error: --optimizer.early_step_in_back")
    assert problem in err[0]


def test_early_step_with_clipping_set_trains_unclipped_and_says_so(tmp_path, capsys):
    """As in torchtitan, a max_norm set with the early step trains, unclipped: the losses are
    those of max_norm 0, though a max_norm this small would change every step it clipped."""
    argv = [*TINY_TRAIN, "--training.local_batch_size", "8", "--training.steps", "3"]
    argv += ["--optimizer.early_step_in_backward"]
    losses = {}
    for max_norm in ("1e-4", "0"):
        out = tmp_path / max_norm
        argv_run = [*argv, "--training.max_norm", max_norm, "--job.dump_folder", str(out)]
        assert train.main(argv_run) == 0
        rows = read_jsonl(out / "metrics.jsonl")
        losses[max_norm] = [r["loss"] for r in rows]
        assert max(r["grad_norm"] for r in rows) > 1e-2  # clipping to 1e-4 would have bitten
    assert losses["1e-4"] == losses["0"] and len(losses["0"]) == 3
    out = capsys.readouterr()
    warned = [line for line in (out.out + out.err).splitlines() if "is not applied" in line]
    assert len(warned) == 1  # once, for the run that set it
    assert warned[0].endswith(
        "WARNING training.max_norm 0.0001 is not applied: optimizer.early_step_in_backward steps "
        "each parameter before the global norm is known, so nothing is clipped (the norm is still "
        "measured and logged); set --training.max_norm 0 to silence this"
    )


def test_early_step_nonfinite_stops_before_the_bad_weights_are_saved(tmp_path, capsys):
    """The step is taken in backward before the norm is known: a non-finite norm cannot prevent
    it, but stops the run before the weights are trained on or checkpointed, and says so."""
    argv = [*TINY_TRAIN, "--training.local_batch_size", "8", *NO_CLIP, "--training.steps", "4"]
    argv += ["--optimizer.early_step_in_backward", "--optimizer.lr", "1e30"]  # blows up at once
    argv += ["--checkpoint.enable", "--checkpoint.interval", "1"]
    assert train.main([*argv, "--job.dump_folder", str(tmp_path)]) == 3
    out = capsys.readouterr()
    assert "non-finite values at step 2" in out.out + out.err
    assert "optimizer step was already taken in backward" in out.out + out.err
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-1"]
