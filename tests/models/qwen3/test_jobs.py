"""Qwen3 through the family-neutral jobs: FLOPs and the planner's shape from its explicit
head_dim, the pipeline schedules its tied flavors refuse, the memory estimate beside a measured
CPU peak, and the fake-backend dry run of 32B at 128 ranks."""

import json

import pytest
import torch
from script_runner import measured_estimate

import train
from titanlite.build import model_args_for
from titanlite.checks import check_job
from titanlite.config import ConfigError
from titanlite.config_parse import parse_args
from titanlite.data.tokenizer import build_tokenizer
from titanlite.models import get_family
from titanlite.parallel_dims import ParallelDims
from titanlite.plan.shape import model_of

QWEN3 = get_family("qwen3")


def test_flops_and_the_planners_shape_use_the_explicit_head_dim():
    """0.6B: 16 heads of 128 over width 1024 (dim // n_heads would say 64); the tied embedding
    is the output projection, so its matmul counts."""
    cfg = parse_args(["--job.config_file", "qwen3_debug.toml", "--model.flavor", "0.6B",
                      "--training.seq_len", "4096"])  # fmt: skip
    model = model_of(cfg, 151936)
    assert (model.shape.head_dim, model.shape.kv_dim) == (128, 8 * 128)
    params = 596_049_920  # the release's count; with the embedding, which is also the output
    assert model.shape.flops_per_token == 6 * params + 12 * 28 * 16 * 128 * 4096
    args = model.args
    assert QWEN3.flops_per_token(params, args, 4096) == model.shape.flops_per_token


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_a_tied_flavor_refuses_v_shaped_pipelines(schedule):
    """Their first and last stage share a rank (as two FSDP roots); other schedules train it."""
    argv = ["--job.config_file", "qwen3_debug.toml", "--model.flavor", "debugmodel_tied",
            "--parallelism.pipeline_parallel_degree", "2"]  # fmt: skip
    args = QWEN3.model_args("debugmodel_tied", vocab_size=512, max_seq_len=32)
    pd = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, world_size=2, pp=2)
    check_job(parse_args(argv), pd, args, 8, 1)  # 1F1B
    cfg = parse_args([*argv, "--parallelism.pipeline_parallel_schedule", schedule])
    with pytest.raises(ConfigError, match="tied output .* V-shaped"):
        check_job(cfg, pd, args, 8, 1)


def test_the_tied_output_stays_the_embedding_through_to_empty():
    args = QWEN3.model_args("debugmodel_tied", vocab_size=512, max_seq_len=32)
    with torch.device("meta"):
        model = QWEN3.model_cls(args)
    model.to_empty(device="cpu")
    assert model.output.weight is model.tok_embeddings.weight
    assert [n for n, _ in model.named_parameters() if "embeddings" in n or "output" in n] == [
        "tok_embeddings.weight"
    ]


@pytest.mark.slow  # trains 2 steps of the debug model under torch's MemTracker
def test_the_estimate_is_within_5_percent_of_the_live_tensors_peak():
    """As for Llama (tests/test_memory_estimate.py): an eager fp32 run without AC."""
    out = measured_estimate("qwen3_debug.toml")
    line = next(x for x in out.splitlines() if x.startswith("measured peak of live tensors"))
    live = float(line.split(": ")[1].split()[0])
    estimated = float(line.split("estimate ")[1].split()[0])
    assert abs(estimated / live - 1) < 0.05, out


@pytest.mark.slow  # builds and draws a 32B rank's share (~1 GiB)
def test_dry_run_of_32b_at_128_ranks(tmp_path):
    argv = ["--job.config_file", "qwen3_debug.toml", "--model.flavor", "32B",
            "--model.vocab_limit", "0", "--training.seq_len", "4096",
            "--training.local_batch_size", "1", "--training.mixed_precision_param", "bfloat16",
            "--comm.mode", "fake_backend", "--comm.fake_world_size", "128",
            "--comm.fake_rank", "5", "--parallelism.tensor_parallel_degree", "8",
            "--activation_checkpoint.mode", "full", "--job.dump_folder", str(tmp_path)]  # fmt: skip
    assert train.main(argv) == 0
    report = json.loads((tmp_path / "dry_run.json").read_text())
    assert report["world_size"] == 128 and "dp_shard=16, cp=1, tp=8" in report["layout"]
    # 64 blocks of width 5120 (64 x 128 query, 8 x 128 kv heads, FFN 25600, QK-norm), untied.
    cfg = parse_args(argv)
    vocab = model_args_for(cfg, build_tokenizer(cfg.model)).vocab_size
    attention = 5120 * (64 * 128 + 2 * 8 * 128) + 64 * 128 * 5120 + 2 * 128
    block = attention + 3 * 5120 * 25600 + 2 * 5120
    assert report["params_total"] == 64 * block + 5120 + 2 * vocab * 5120
    assert report["params_local"] == pytest.approx(report["params_total"] / 128, rel=0.01)
    assert report["weights_drawn"] and report["estimated_peak_gib"] > 0
