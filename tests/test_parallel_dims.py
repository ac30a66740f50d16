"""ParallelDims: degree resolution and validation (pure Python), and the meshes it builds on
4 real gloo ranks (this file is also the torchrun worker)."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import torchrun_script

from titanlite.distributed import destroy
from titanlite.models.llama.args import ModelArgs
from titanlite.parallel_dims import ParallelDims

# (dp_replicate, dp_shard, tp) layouts of 4 ranks checked in the worker.
LAYOUTS = [(1, 4, 1), (2, 2, 1), (4, 1, 1), (1, 2, 2), (2, 1, 2), (1, 1, 4)]


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
    assert "tensor_parallel_degree (1) = 6, but the world size is 4" in msg


@pytest.mark.parametrize(
    "degrees,match",
    [
        ((0, -1, 1), "data_parallel_replicate_degree must be >= 1"),
        ((1, -1, 0), "tensor_parallel_degree must be >= 1"),
        ((1, 0, 1), "data_parallel_shard_degree must be >= 1 or -1"),
        ((1, -1, 3), "cannot infer data_parallel_shard_degree"),
    ],
)
def test_bad_degrees(degrees, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(*degrees, world_size=4)


ARGS = ModelArgs(dim=256, n_layers=2, n_heads=16, n_kv_heads=4, vocab_size=512)


def test_tp_must_divide_heads_and_kv_heads():
    ParallelDims(1, 1, 4, 4).validate_model(ARGS)
    with pytest.raises(ValueError, match=r"n_heads \(16\) and n_kv_heads \(4\)"):
        ParallelDims(1, 1, 8, 8).validate_model(ARGS)


def test_loss_parallel_needs_tp():
    lp = SimpleNamespace(enable_loss_parallel=True)
    with pytest.raises(ValueError, match="enable_loss_parallel needs tensor_parallel_degree > 1"):
        ParallelDims(1, 4, 1, 4).validate_model(ARGS, lp)
    ParallelDims(1, 2, 2, 4).validate_model(ARGS, lp)
    ParallelDims(1, 3, 1, 3).validate_model(ARGS)  # uneven FSDP shards are fine


def worker(out_path):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {}
    for layout in LAYOUTS:
        pd = ParallelDims(*layout, world_size=dist.get_world_size())
        pd.build_mesh("cpu")
        dp_ranks = [None] * 4
        dist.all_gather_object(dp_ranks, pd.dp_rank)
        results[str(layout)] = {
            "dp_ranks": dp_ranks,
            "dp_size": pd.dp_mesh.size() if pd.dp_mesh is not None else None,
            "fsdp_shape": list(pd.fsdp_mesh.shape),
            "tp_size": pd.tp_mesh.size() if pd.tp_mesh is not None else None,
        }
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    destroy()  # barrier first: gloo aborts a rank whose peer leaves mid-exchange


@pytest.mark.slow
def test_meshes_on_four_ranks(tmp_path):
    out = tmp_path / "meshes.json"
    torchrun_script(__file__, out)
    res = json.loads(out.read_text())
    # Row-major (dp_replicate, dp_shard, tp): TP neighbours share a dp rank.
    assert res["(1, 4, 1)"] == {
        "dp_ranks": [0, 1, 2, 3], "dp_size": 4, "fsdp_shape": [4], "tp_size": None
    }  # fmt: skip
    assert res["(2, 2, 1)"]["fsdp_shape"] == [2, 2]  # HSDP: (replicate, shard)
    assert res["(4, 1, 1)"]["fsdp_shape"] == [4, 1]  # pure replication via HSDP, shard group 1
    assert res["(1, 2, 2)"] == {
        "dp_ranks": [0, 0, 1, 1], "dp_size": 2, "fsdp_shape": [2], "tp_size": 2
    }  # fmt: skip
    assert res["(2, 1, 2)"]["dp_ranks"] == [0, 0, 1, 1]
    # No data parallelism: FSDP (mixed precision only) runs over a one-rank shard mesh.
    assert res["(1, 1, 4)"] == {
        "dp_ranks": [0, 0, 0, 0], "dp_size": None, "fsdp_shape": [1], "tp_size": 4
    }  # fmt: skip


if __name__ == "__main__":
    worker(sys.argv[1])
