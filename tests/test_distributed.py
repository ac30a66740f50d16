"""init_distributed, reductions and the cross-mesh gradient clip: in one process, and on 4 gloo
ranks launched by torchrun (this file is also the worker)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import torchrun_script
from torch import nn

from titanlite.distributed import (
    PeerFailure,
    clip_grad_norm_,
    destroy,
    device_and_backend,
    dist_sum,
    init_distributed,
    peers_watched,
    store_namespace,
    world_sum,
)


def make_grads(seed=0):
    """A small model with gradients, built and filled the same way in every process."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.RMSNorm(8), nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 8, bias=False)
    )
    model(torch.randn(4, 8)).pow(2).sum().backward()
    return model


def test_plain_python_is_world_one(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    rank, local_rank, world, device = init_distributed()
    try:
        assert (rank, local_rank, world) == (0, 0, 1)
        assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
        # A one-rank group of its own, so meshes (and FSDP's mixed precision) exist in world 1.
        assert torch.distributed.get_world_size() == 1
        x = torch.tensor([1.0, 5.0])
        assert torch.equal(dist_sum(x), x) and torch.equal(world_sum(x), x)
    finally:
        destroy()
    assert not torch.distributed.is_initialized()
    destroy()  # no process group left: a no-op


@pytest.mark.parametrize(
    "cuda, cpu_backend, expected",
    [
        (True, False, ("cuda:1", "nccl")),
        (True, True, ("cuda:1", "cuda:nccl,cpu:gloo")),  # FSDP's CPU offload reduces CPU grads
        (False, True, ("cpu", "gloo")),
    ],
)
def test_device_and_backend_follow_what_is_present(cuda, cpu_backend, expected):
    device, backend = device_and_backend(1, cpu_backend, cuda)
    assert (str(device), backend) == expected


@pytest.mark.parametrize("cuda", [True, False])
def test_nccl_communicator_starts_eagerly_only_on_cuda(cuda, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **kw: calls.append(kw))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    init_distributed()
    assert calls[0]["device_id"] == (torch.device("cuda", 0) if cuda else None)


def test_clip_matches_torch():
    ours, ref = make_grads(), make_grads()
    norm = clip_grad_norm_(ours.parameters(), 0.5)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    torch.testing.assert_close(norm, ref_norm)
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_measure_only_and_nonfinite_leave_grads():
    model = make_grads()
    before = [p.grad.clone() for p in model.parameters()]
    norm = clip_grad_norm_(model.parameters(), 0.0)
    assert norm > 0
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))
    model[1].weight.grad[0, 0] = float("inf")
    assert torch.isinf(clip_grad_norm_(model.parameters(), 1.0))
    assert torch.equal(model[0].weight.grad, before[0])  # not scaled by 1/inf


def test_norm_of_a_large_grad_is_exact_on_cpu():
    """fp32 CPU norms drift ~1e-4 on tens of millions of elements, differently per shard layout."""
    p = nn.Parameter(torch.empty(8_000_000))
    p.grad = torch.rand(8_000_000, generator=torch.Generator().manual_seed(0))
    exact = p.grad.double().norm().item()
    assert clip_grad_norm_([p], 0.0).item() == pytest.approx(exact, rel=1e-7)


def worker(out_path):
    """Mixed meshes: TP only on the linears, the norm weight on no mesh at all: torch's
    clip_grad_norm_ cannot stack norms from different meshes."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from titanlite.parallel_dims import ParallelDims

    rank, local_rank, world, device = init_distributed()
    pd = ParallelDims(1, 2, 2, world)
    pd.build_mesh(device.type)
    total = dist_sum(torch.tensor(float(rank)), pd.dp_mesh)  # dp groups {0,2} and {1,3}
    everyone = world_sum(torch.tensor(float(rank)))
    # The step's token count: one rank of each TP group ({0,1} and {2,3}) counts its labels.
    counters = world_sum(torch.tensor([float(rank) if pd.counts_step_tokens else 0.0]))
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.RMSNorm(8), nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 8, bias=False)
    )
    parallelize_module(model, pd.tp_mesh, {"1": ColwiseParallel(), "3": RowwiseParallel()})
    model(torch.randn(4, 8)).pow(2).sum().backward()
    norm = clip_grad_norm_(model.parameters(), 0.5)
    clipped = [
        p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        for p in model.parameters()
    ]
    res = {
        "world": world,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "sum": total.item(),
        "world_sum": everyone.item(),
        "counters": counters.item(),
        "norm": norm.item(),
        "grads": [g.tolist() for g in clipped],
        "gloo_threads": gloo_threads(),
    }
    destroy()  # while the meshes live on, as DTensor's caches keep a finished run's meshes
    res["gloo_threads_after_destroy"] = gloo_threads()
    if rank == 0:
        Path(out_path).write_text(json.dumps(res))


def gloo_threads() -> int:
    """This process's gloo worker threads (torch names them): two per live gloo group."""
    tasks = Path("/proc/self/task")
    return sum((t / "comm").read_text().strip() == "pt_gloo_runloop" for t in tasks.iterdir())


@pytest.mark.slow
def test_four_ranks(tmp_path):
    out = tmp_path / "dist.json"
    torchrun_script(__file__, out)
    res = json.loads(out.read_text())
    assert (res["world"], res["device"], res["threads"]) == (4, "cpu", 1)
    assert res["sum"] == 2.0  # rank 0's dp group is {0, 2}
    assert (res["world_sum"], res["counters"]) == (6.0, 2.0)  # ranks 0 and 2 count tokens
    # Every group is closed by destroy(), after its barrier, not at interpreter exit.
    assert res["gloo_threads"] > 0 and res["gloo_threads_after_destroy"] == 0
    ref = make_grads()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    assert res["norm"] == pytest.approx(ref_norm.item(), rel=1e-5)
    for got, p in zip(res["grads"], ref.parameters(), strict=True):
        torch.testing.assert_close(torch.tensor(got), p.grad, rtol=1e-5, atol=1e-7)


if __name__ == "__main__":
    worker(sys.argv[1])


def test_store_namespace_per_attempt_only_where_torchruns_store_outlives_the_group():
    """The agent's shared store keeps every attempt's keys: each attempt its own namespace. With
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (an elastic node range) each group gets a fresh store,
    where the agents' restart counts may differ: a node that joined counts from 0."""
    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2"}
    assert store_namespace(shared) == "titanlite/attempt_2/"
    fresh = {"TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert store_namespace({**fresh, "TORCHELASTIC_RESTART_COUNT": "1"}) == "titanlite/"
    assert store_namespace({**fresh, "TORCHELASTIC_RESTART_COUNT": "0"}) == "titanlite/"


def test_a_lost_peer_is_one_line_naming_the_step_and_the_timeout_in_force():
    gloo = "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:9092: Connection reset by peer"
    saving = peers_watched(3, 300, "comm.init_timeout_seconds while saving")
    with pytest.raises(PeerFailure) as info, saving:
        raise RuntimeError(gloo)
    assert str(info.value) == (
        "step 3: a collective failed, a rank died or hangs (the timeout is 300 s, "
        f"comm.init_timeout_seconds while saving): {gloo}"
    )
    # A save's failure inside the step's watch: as the save's watch said it.
    with pytest.raises(PeerFailure) as outer, peers_watched(3, 10), peers_watched(3, 300, "saving"):
        raise RuntimeError(gloo)
    assert "(the timeout is 300 s, saving)" in str(outer.value)
    with pytest.raises(RuntimeError, match="shape mismatch"), peers_watched(3, 10):
        raise RuntimeError("shape mismatch")  # not a lost peer: untouched
