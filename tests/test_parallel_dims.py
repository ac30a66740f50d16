"""ParallelDims: degree resolution and validation (pure Python), and the meshes it builds on
4 real gloo ranks (this file is also the torchrun worker)."""

import json
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import torchrun_script

from titanlite.distributed import destroy
from titanlite.models.llama.args import ModelArgs
from titanlite.parallel_dims import ParallelDims

# (dp_replicate, dp_shard, cp, tp) layouts of 4 ranks checked in the worker.
LAYOUTS = [
    (1, 4, 1, 1), (2, 2, 1, 1), (4, 1, 1, 1), (1, 2, 1, 2), (2, 1, 1, 2), (1, 1, 1, 4),
    (1, 2, 2, 1), (2, 1, 2, 1), (1, 1, 2, 2), (1, 1, 4, 1),
]  # fmt: skip
# (pp, dp_replicate, dp_shard, cp, tp) pipelined layouts of 4 ranks.
PP_LAYOUTS = [(2, 1, 2, 1, 1), (2, 1, 1, 1, 2), (4, 1, 1, 1, 1)]


def test_infers_shard_degree():
    pd = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=8)
    assert (pd.dp_shard, pd.dp_degree) == (2, 4)
    assert pd.tp_enabled and pd.fsdp_enabled and pd.hsdp_enabled and pd.dp_enabled


def test_world_one_has_no_parallelism():
    pd = ParallelDims(1, -1, 1, 1)
    assert (pd.dp_degree, pd.dp_rank) == (1, 0)
    assert not (pd.dp_enabled or pd.tp_enabled or pd.fsdp_enabled or pd.hsdp_enabled)


def test_product_mismatch_names_every_degree():
    with pytest.raises(ValueError) as e:
        ParallelDims(dp_replicate=2, dp_shard=3, tp=1, world_size=4)
    msg = str(e.value)
    assert "data_parallel_replicate_degree (2) x data_parallel_shard_degree (3)" in msg
    assert "context_parallel_degree (1) x tensor_parallel_degree (1) = 6, but the world" in msg


@pytest.mark.parametrize(
    "degrees,match",
    [
        ((0, -1, 1), "data_parallel_replicate_degree must be >= 1"),
        ((1, -1, 0), "tensor_parallel_degree must be >= 1"),
        ((1, 0, 1), "data_parallel_shard_degree must be >= 1 or -1"),
        ((1, -1, 3), "cannot infer data_parallel_shard_degree"),
        ((1, -1, 1, 0), "context_parallel_degree must be >= 1"),
        ((1, -1, 1, 3), r"context_parallel_degree \(3\) x tensor_parallel_degree \(1\) = 3;"),
        ((1, 2, 2, 2), r"shard_degree \(2\) x context_parallel_degree \(2\) x .* = 8, but the"),
        ((1, -1, 1, 1, 0), "pipeline_parallel_degree must be >= 1"),
        ((1, -1, 1, 1, 3), r"pipeline_parallel_degree \(3\) x data_parallel_replicate_degree"),
        ((1, 4, 1, 1, 2), r"pipeline_parallel_degree \(2\) x .* = 8, but the world size is 4"),
    ],
)
def test_bad_degrees(degrees, match):
    dp_replicate, dp_shard, tp, cp, pp = (*degrees, 1, 1)[:5]
    with pytest.raises(ValueError, match=match):
        ParallelDims(dp_replicate, dp_shard, tp, world_size=4, cp=cp, pp=pp)


ARGS = ModelArgs(dim=256, n_layers=2, n_heads=16, n_kv_heads=4, vocab_size=512)


def test_tp_must_divide_heads_and_kv_heads():
    ParallelDims(1, 1, 4, 4).validate_model(ARGS)
    with pytest.raises(ValueError, match=r"n_heads \(16\) and n_kv_heads \(4\)"):
        ParallelDims(1, 1, 8, 8).validate_model(ARGS)


def test_cp_needs_two_chunks_per_rank():
    args = ModelArgs(dim=256, n_layers=2, n_heads=16, n_kv_heads=4, vocab_size=512, max_seq_len=36)
    ParallelDims(1, 1, 1, 3, cp=3).validate_model(args)  # 6 chunks of 6 tokens
    ParallelDims(1, 1, 1, 1).validate_model(replace(args, max_seq_len=35))  # no CP: any length
    with pytest.raises(ValueError, match=r"seq_len \(36\) must be divisible by 2 x cont.* \(8\)"):
        ParallelDims(1, 1, 1, 4, cp=4).validate_model(args)


def test_pp_cp_and_document_masking_compose():
    """Every combination is a valid layout (each is proven equal to one process in
    tests/integration); the sequence still splits into 2 x CP chunks under PP."""
    masked = replace(ARGS, document_masking=True, bos_id=1, eos_id=2, max_seq_len=32)
    ParallelDims(1, 1, 1, 2, pp=2).validate_model(masked)
    ParallelDims(1, 1, 1, 2, cp=2).validate_model(masked)
    ParallelDims(1, 1, 2, 8, cp=2, pp=2).validate_model(masked)
    with pytest.raises(ValueError, match=r"seq_len \(34\) must be divisible by 2 x cont"):
        ParallelDims(1, 1, 1, 4, cp=2, pp=2).validate_model(replace(masked, max_seq_len=34))


def test_loss_parallel_is_on_under_tp_unless_disabled():
    on, off = (
        SimpleNamespace(disable_loss_parallel=False),
        SimpleNamespace(disable_loss_parallel=True),
    )
    assert ParallelDims(1, 2, 2, 4).loss_parallel(on)
    assert not ParallelDims(1, 2, 2, 4).loss_parallel(off)
    assert not ParallelDims(1, 4, 1, 4).loss_parallel(on)  # no TP: nothing to shard the vocab over
    ParallelDims(1, 3, 1, 3).validate_model(ARGS)  # uneven FSDP shards are fine


def worker(out_path):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {}
    for layout in [(1, *degrees) for degrees in LAYOUTS] + PP_LAYOUTS:
        pp, dp_replicate, dp_shard, cp, tp = layout
        world = dist.get_world_size()
        pd = ParallelDims(dp_replicate, dp_shard, tp, world_size=world, cp=cp, pp=pp)
        pd.build_mesh("cpu")
        per_rank = [None] * 4
        pp_rank = pd.pp_mesh.get_local_rank() if pd.pp_mesh is not None else 0
        dist.all_gather_object(per_rank, (pd.dp_rank, pd.counts_step_tokens, pp_rank))
        results[str(layout[1:] if pp == 1 else layout)] = {
            "dp_ranks": [dp_rank for dp_rank, _, _ in per_rank],
            "counting": [rank for rank, (_, counts, _) in enumerate(per_rank) if counts],
            "dp_size": pd.dp_mesh.size() if pd.dp_mesh is not None else None,
            "loss_size": pd.loss_mesh.size() if pd.loss_mesh is not None else None,
            "fsdp_shape": list(pd.fsdp_mesh.shape),
            "tp_size": pd.tp_mesh.size() if pd.tp_mesh is not None else None,
            **({"pp_ranks": [r for _, _, r in per_rank]} if pp > 1 else {}),
        }
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    destroy()  # barrier first: gloo aborts a rank whose peer leaves mid-exchange


@pytest.mark.slow
def test_meshes_on_four_ranks(tmp_path):
    out = tmp_path / "meshes.json"
    torchrun_script(__file__, out)
    res = json.loads(out.read_text())
    # Row-major (dp_replicate, dp_shard, cp, tp): TP neighbours share a dp rank.
    assert res["(1, 4, 1, 1)"] == {
        "dp_ranks": [0, 1, 2, 3], "counting": [0, 1, 2, 3], "dp_size": 4, "loss_size": 4,
        "fsdp_shape": [4], "tp_size": None,
    }  # fmt: skip
    assert res["(2, 2, 1, 1)"]["fsdp_shape"] == [2, 2]  # HSDP: (replicate, shard)
    assert res["(4, 1, 1, 1)"]["fsdp_shape"] == [4, 1]  # pure replication via HSDP, shard group 1
    assert res["(1, 2, 1, 2)"] == {
        "dp_ranks": [0, 0, 1, 1], "counting": [0, 2], "dp_size": 2, "loss_size": 2,
        "fsdp_shape": [2], "tp_size": 2,
    }  # fmt: skip
    assert res["(2, 1, 1, 2)"]["dp_ranks"] == [0, 0, 1, 1]
    # No data parallelism: FSDP (mixed precision only) runs over a one-rank shard mesh.
    assert res["(1, 1, 1, 4)"] == {
        "dp_ranks": [0, 0, 0, 0], "counting": [0], "dp_size": None, "loss_size": None,
        "fsdp_shape": [1], "tp_size": 4,
    }  # fmt: skip
    # CP peers read the same samples (one counts their labels), sum their loss parts, and FSDP
    # shards over dp_shard x cp.
    assert res["(1, 2, 2, 1)"] == {
        "dp_ranks": [0, 0, 1, 1], "counting": [0, 2], "dp_size": 2, "loss_size": 4,
        "fsdp_shape": [4], "tp_size": None,
    }  # fmt: skip
    assert res["(2, 1, 2, 1)"]["fsdp_shape"] == [2, 2]  # HSDP: (replicate, shard x cp)
    assert res["(1, 1, 2, 2)"] == {
        "dp_ranks": [0, 0, 0, 0], "counting": [0], "dp_size": None, "loss_size": 2,
        "fsdp_shape": [2], "tp_size": 2,
    }  # fmt: skip
    assert res["(1, 1, 4, 1)"]["fsdp_shape"] == [4]
    # Pipeline stages are the outermost dim: each stage's ranks form the whole inner mesh; only
    # the first stage counts tokens, and the loss is summed over stages (the last one has it).
    assert res["(2, 1, 2, 1, 1)"] == {
        "dp_ranks": [0, 1, 0, 1], "counting": [0, 1], "dp_size": 2, "loss_size": 4,
        "fsdp_shape": [2], "tp_size": None, "pp_ranks": [0, 0, 1, 1],
    }  # fmt: skip
    assert res["(2, 1, 1, 1, 2)"] == {
        "dp_ranks": [0, 0, 0, 0], "counting": [0], "dp_size": None, "loss_size": 2,
        "fsdp_shape": [1], "tp_size": 2, "pp_ranks": [0, 0, 1, 1],
    }  # fmt: skip
    assert res["(4, 1, 1, 1, 1)"]["pp_ranks"] == [0, 1, 2, 3]


if __name__ == "__main__":
    worker(sys.argv[1])
