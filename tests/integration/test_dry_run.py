"""train.py's whole-model jobs that run in one process: the dry run at a target world size over
a fake process group, and the seed checkpoint; and a resumed run that draws no weights."""

import json
from dataclasses import replace

import pytest
import torch
from torch.distributed.tensor import DTensor

import train
from titanlite.build import model_args_for
from titanlite.config_parse import parse_args
from titanlite.data.tokenizer import build_tokenizer
from titanlite.distributed import init_distributed
from titanlite.models import FAMILIES
from titanlite.models.decoder.model import Transformer

SMALL = ["--job.config_file", "debug_model.toml", "--model.vocab_limit", "512"]
SMALL += ["--training.seq_len", "32", "--training.local_batch_size", "2"]


def run(args, capsys):
    """train.main in this process (the dry run and the seed checkpoint are one process's jobs):
    (exit status, stderr)."""
    code = train.main(args)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "flavor, world, tp",
    [("debugmodel", 64, 8), pytest.param("8B", 64, 8, marks=pytest.mark.slow)],
)
def test_dry_run_builds_only_this_ranks_share(tmp_path, capsys, flavor, world, tp):
    args = ["--job.config_file", "debug_model.toml", "--model.flavor", flavor]
    args += ["--comm.mode", "fake_backend", "--comm.fake_world_size", str(world)]
    args += ["--comm.fake_rank", "3", "--parallelism.tensor_parallel_degree", str(tp)]
    code, err = run([*args, "--job.dump_folder", str(tmp_path)], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "dry_run.json").read_text())
    assert (report["world_size"], report["rank"]) == (world, 3)
    assert f"dp_shard={world // tp}, cp=1, tp={tp}" in report["layout"]
    # FSDP pads uneven dims (the norms) by at most a row per parameter.
    assert report["params_local"] == pytest.approx(report["params_total"] / world, rel=0.01)
    cfg = parse_args(args)
    model_args = model_args_for(cfg, build_tokenizer(cfg.model))
    with torch.device("meta"):
        assert report["params_total"] == Transformer(model_args).num_params(False)
    assert report["checkpoint_bytes"] == 12 * report["params_total"]  # fp32 weights + 2 moments
    assert report["init_seconds"] > 0 and report["estimated_peak_gib"] > 0
    assert report["weights_drawn"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dry_run.json"]  # nothing else written


def test_alltoall_rotation_runs_the_all_gather_and_says_so(tmp_path, capsys):
    """torchtitan's --parallelism.context_parallel_rotate_method alltoall is accepted: K/V are
    all-gathered (the same numbers: test_parallel_numerics.py's cp4_alltoall), and one line says
    so."""
    args = [*SMALL, "--comm.mode", "fake_backend", "--comm.fake_world_size", "2"]
    args += ["--parallelism.context_parallel_degree", "2"]
    args += ["--parallelism.context_parallel_rotate_method", "alltoall"]
    code = train.main([*args, "--job.dump_folder", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.count("K/V are all-gathered instead of passed around the ring") == 1  # the log


def test_dry_run_without_drawing_weights_reports_the_same_shares(tmp_path, capsys, monkeypatch):
    """--no-comm.fake_init_weights (the planner's check): built and allocated, nothing drawn."""
    args = [*SMALL, "--comm.mode", "fake_backend", "--comm.fake_world_size", "8"]
    reports = []
    for draw in ("--comm.fake_init_weights", "--no-comm.fake_init_weights"):
        code, err = run([*args, draw, "--job.dump_folder", str(tmp_path / draw)], capsys)
        assert code == 0, err
        reports.append(json.loads((tmp_path / draw / "dry_run.json").read_text()))
    drawn, bare = reports
    assert drawn["weights_drawn"] and not bare["weights_drawn"]
    same = ("layout", "params_total", "params_local", "estimated_peak_gib", "checkpoint_bytes")
    assert {k: drawn[k] for k in same} == {k: bare[k] for k in same}


def test_dry_run_under_pp_builds_this_ranks_stage(tmp_path, capsys):
    """Rank 40 of 64 = PP 2 x dp_shard 2 x CP 2 x TP 8, with document masking, is on the second
    of two stages: layers 3-5, the final norm and the output; FSDP shards over dp_shard x CP, so
    its shard is 1/32 of that stage, its estimate the last stage's."""
    args = [*SMALL, "--comm.mode", "fake_backend", "--comm.fake_world_size", "64"]
    args += ["--comm.fake_rank", "40", "--parallelism.tensor_parallel_degree", "8"]
    args += ["--parallelism.pipeline_parallel_degree", "2"]
    args += ["--parallelism.context_parallel_degree", "2", "--model.document_masking"]
    code, err = run([*args, "--job.dump_folder", str(tmp_path)], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "dry_run.json").read_text())
    assert "pp=2, dp_replicate=1, dp_shard=2, cp=2, tp=8" in report["layout"]
    assert report["pipeline_stages"] == {"1": [3, 5]}
    cfg = parse_args(args)
    model_args = model_args_for(cfg, build_tokenizer(cfg.model))
    with torch.device("meta"):
        whole = Transformer(model_args)
    held = ("layers.3.", "layers.4.", "layers.5.", "norm.", "output.")
    stage = sum(p.numel() for n, p in whole.named_parameters() if n.startswith(held))
    assert report["params_local"] == pytest.approx(stage / 32, rel=0.01)


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--comm.fake_world_size", "6", "--parallelism.tensor_parallel_degree", "4"],
            "world size",
        ),
        (["--comm.fake_world_size", "2", "--comm.fake_rank", "2"], "fake_rank (2)"),
        (["--comm.fake_world_size", "0"], "--comm.fake_world_size N"),
    ],
)
def test_dry_run_rejects_a_layout_the_job_would_reject(tmp_path, capsys, args, expected):
    argv = [*SMALL, "--comm.mode", "fake_backend", *args, "--job.dump_folder", str(tmp_path)]
    code, err = run(argv, capsys)
    assert code == 2 and expected in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "option", [["--comm.fake_world_size", "8"], ["--no-comm.fake_init_weights"]]
)
def test_fake_world_without_the_fake_backend_is_an_error(capsys, option):
    code, err = run([*SMALL, *option], capsys)
    assert code == 2 and "--comm.mode fake_backend" in err


def test_seed_checkpoint_holds_the_drawn_weights_and_loading_it_draws_none(tmp_path, monkeypatch):
    seed_args = [*SMALL, "--debug.seed", "5", "--job.dump_folder", str(tmp_path / "seed")]
    assert train.main([*seed_args, "--checkpoint.create_seed_checkpoint"]) == 0
    step0 = tmp_path / "seed" / "checkpoint" / "step-0"
    assert (step0 / "COMPLETE").is_file()

    def no_draws(*_):
        raise AssertionError("weights drawn although a checkpoint overwrites them")

    llama3 = replace(FAMILIES["llama3"], init_weights=no_draws)
    monkeypatch.setitem(FAMILIES, "llama3", llama3)
    cfg = parse_args([*SMALL, "--checkpoint.initial_load_path", str(step0),
                      "--job.dump_folder", str(tmp_path / "run")])  # fmt: skip
    trainer = train.Trainer(cfg, init_distributed())
    try:
        want = Transformer(trainer.model_args)
        want.init_weights(seed=5)
        got = trainer.model.state_dict()  # one-rank FSDP: DTensors
        for name, value in want.state_dict().items():
            mine = got[name].full_tensor() if isinstance(got[name], DTensor) else got[name]
            assert torch.equal(mine, value), name
        assert torch.equal(trainer.model.rope_cache, want.rope_cache)  # buffers still computed
    finally:
        trainer.close()
