"""Each shim of titanlite/torch_compat.py does what its caller relies on, under this torch.

Run under every supported release: `scripts/check_torch.sh 2.11.0 tests/test_torch_compat.py`.
"""

import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from titanlite import torch_compat as tc


@pytest.fixture
def one_rank_group():
    """A one-rank gloo process group in this process, torn down after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


# A fake world of 8 plays rank 3: the store, a 2 x 4 mesh, a flattened mesh over both dims, a
# shard's place, then teardown's release of the mesh's groups. Its own process: a fake default
# group would stay behind in this one.
_FAKE_WORLD = """
import json, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from titanlite import torch_compat as tc

dist.init_process_group("fake", store=tc.fake_store(), rank=3, world_size=8)
mesh = tc.track_mesh(init_device_mesh("cpu", (2, 4), mesh_dim_names=("a", "b")))
flat = tc.flatten_mesh(mesh, "ab")
x = distribute_tensor(torch.zeros(10, 4), mesh["b"], [Shard(0)])
shape, offset = tc.local_shape_and_offset(x.shape, x.device_mesh, x.placements)
# A second mesh of the same shape (equal to the first as a DeviceMesh) holds groups of its own.
twin = tc.track_mesh(init_device_mesh("cpu", (2, 4), mesh_dim_names=("a", "b")))
groups_before = len(getattr(mesh, "_pg_registry", {}))
tc.release_mesh_groups()
print(json.dumps({
    "world": dist.get_world_size(), "rank": dist.get_rank(), "flat": flat.size(),
    "flat_rank": flat.get_local_rank(), "shape": shape, "offset": offset,
    "groups_before": groups_before,
    "groups_after": len(getattr(mesh, "_pg_registry", {})) + len(getattr(twin, "_pg_registry", {})),
    "has_registry": hasattr(mesh, "_pg_registry"),
}))
"""


def test_fake_world_meshes_flatten_and_release():
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_FAKE_WORLD)],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    got = json.loads(out.strip().splitlines()[-1])
    assert (got["world"], got["rank"]) == (8, 3)
    assert (got["flat"], got["flat_rank"]) == (8, 3)
    # Rank 3 is the last of "b"'s 4 ranks: rows 9..10 of 10 split as 3, 3, 3, 1.
    assert got["shape"] == [1, 4] and got["offset"] == [9, 0]
    if got["has_registry"]:  # torch 2.13: the root mesh holds its groups, released at teardown
        assert got["groups_before"] >= 3 and got["groups_after"] == 0


def test_group_timeout_is_set_on_every_group(one_rank_group):
    assert one_rank_group in tc.process_groups()
    tc.set_group_timeout(one_rank_group, 7)
    backend = one_rank_group._get_backend(torch.device("cpu"))
    assert backend.options._timeout.total_seconds() == 7


def test_all_gather_autograd_gathers_and_passes_the_gradient_back(one_rank_group):
    x = torch.randn(3, 4, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # not a name this torch deprecates
        out = tc.all_gather_autograd(x, 0, one_rank_group)
    assert torch.equal(out, x)  # one rank: the gathered tensor is its own
    (out * 2).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_foreach_norm_is_each_tensors_norm():
    tensors = [torch.randn(3, 5), torch.randn(7), torch.zeros(2)]
    norms = tc.foreach_norm(tensors, torch.float64)
    expected = [torch.linalg.vector_norm(t.double()) for t in tensors]
    assert all(n.dtype == torch.float64 for n in norms)
    torch.testing.assert_close(torch.stack(norms), torch.stack(expected))


def test_cpu_flash_attention_ops_are_sdpa_and_its_gradient():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    flash, flash_backward = tc.cpu_flash_attention_ops()
    out, lse = flash(q, k, v, 0.0, True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    dq, dk, dv = flash_backward(grad, q, k, v, out, lse, 0.0, True)
    torch.testing.assert_close((dq, dk, dv), torch.autograd.grad(expected, (q, k, v), grad))


def test_selective_ac_saves_the_attention_op_sdpa_runs_here():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ran.append(func)
            return func(*args, **(kwargs or {}))

    ran = []
    q = torch.randn(1, 2, 8, 16)
    with Record():
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    saved = tc.selective_ac_saved_ops()
    assert torch.ops.aten.mm.default in saved
    assert any(op in saved for op in ran), ran


def test_checkpoint_wrapper_recomputes_to_the_same_gradients():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    block(x).sum().backward()
    expected = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    wrapped = tc.checkpoint_wrapper(block, preserve_rng_state=False)
    assert wrapped is not block
    wrapped(x).sum().backward()
    torch.testing.assert_close([p.grad for p in block.parameters()], expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="memory history needs CUDA")
def test_cuda_memory_history_records_an_allocation():
    tc.record_cuda_memory_history(1000)
    try:
        torch.empty(1 << 20, device="cuda")
        snapshot = tc.cuda_memory_snapshot()
    finally:
        tc.record_cuda_memory_history(None)
    assert any(t["trace"] for t in snapshot["device_traces"])


def test_cuda_memory_history_names_exist():
    # On a CPU the calls cannot run; the names they use must still exist in this release.
    assert callable(torch.cuda.memory._record_memory_history)
    assert callable(torch.cuda.memory._snapshot)


def test_state_dict_stager_copies_into_kept_buffers():
    stager = tc.state_dict_stager(pin_memory=False)
    state = {"w": torch.arange(6.0), "step": 3}
    first = stager.stage(state)
    state["w"] += 1
    second = stager.stage(state)
    assert first["w"].untyped_storage().data_ptr() != state["w"].untyped_storage().data_ptr()
    assert second["w"].untyped_storage().data_ptr() == first["w"].untyped_storage().data_ptr()
    assert second["w"].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] and second["step"] == 3
    stager.close()


def test_consolidate_hf_safetensors_writes_whole_files(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    state = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4)}
    sharded, out = tmp_path / "sharded", tmp_path / "out"
    out.mkdir()
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(sharded), save_distributed=True))
    tc.consolidate_hf_safetensors(str(sharded), str(out), {"a": 1, "b": 2})
    files = sorted(out.glob("*.safetensors"))
    assert len(files) == 2
    loaded = {**load_file(files[0]), **load_file(files[1])}
    torch.testing.assert_close(loaded, state)


def test_fsspec_checkpoint_io_saves_and_loads_through_an_fsspec_url():
    writer_class, reader_class = tc.fsspec_checkpoint_io()
    state = {"w": torch.arange(6.0).reshape(2, 3), "blob": b"x"}
    url = f"memory://titanlite-compat/{id(state)}"  # fsspec's in-memory file system
    with warnings.catch_warnings():  # DCP: no process group, so one process
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=writer_class(url, sync_files=False))
        loaded = {"w": torch.zeros(2, 3), "blob": b""}
        dcp.load(loaded, storage_reader=reader_class(url))
    assert torch.equal(loaded["w"], state["w"]) and loaded["blob"] == b"x"


def test_file_view_offset_and_narrow_read_a_saved_tensor(tmp_path):
    t = torch.arange(12, dtype=torch.float32).view(4, 3)
    path = tmp_path / "t.pt"
    torch.save(t, path)
    placed = torch.load(path, map_location="meta", weights_only=True)
    data = path.read_bytes()
    start = tc.storage_file_offset(placed)
    read = torch.frombuffer(bytearray(data[start : start + t.nbytes]), dtype=torch.float32)
    assert torch.equal(read.view(4, 3), t)
    # The archive behind a prefix, as in a DCP file holding several items.
    prefixed = tmp_path / "prefixed"
    prefixed.write_bytes(b"x" * 100 + data)
    with open(prefixed, "rb") as f:
        loaded = torch.load(tc.file_view(f, 100, len(data)), weights_only=True)
    assert torch.equal(loaded, t)
    assert torch.equal(tc.narrow_by_index(t, [1, 1], [2, 2]), t[1:3, 1:3])


def test_fake_tensor_mode_saves_a_skeleton(tmp_path):
    with tc.fake_tensor_mode():
        fake = torch.empty(3, 5, dtype=torch.bfloat16)
    path = tmp_path / "skeleton.pt"
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save({"w": fake}, path)
    loaded = torch.load(path, map_location="meta", weights_only=True)
    assert loaded["w"].shape == (3, 5) and loaded["w"].dtype == torch.bfloat16


def test_pipeline_actions_parse_and_check():
    action = tc.pipeline_action("2F0")
    assert (action.stage_index, action.microbatch_index, action.is_compute_op) == (2, 0, True)
    assert tc.pipeline_action("") is None
    with pytest.raises(RuntimeError):
        tc.pipeline_action("xyz")
    rows = {0: [tc.pipeline_action(c) for c in ("0F0", "0F1", "0B0", "0B1")]}
    tc.check_pipeline_actions(rows, 1, 1, 2, owner=lambda stage: 0)
    backward_first = {0: [tc.pipeline_action(c) for c in ("0B0", "0F0", "0F1", "0B1")]}
    with pytest.raises(AssertionError):
        tc.check_pipeline_actions(backward_first, 1, 1, 2, owner=lambda stage: 0)


def test_csv_schedule_runs_a_stage_to_the_plain_gradients(one_rank_group, tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    nn.functional.mse_loss(model(x), y, reduction="sum").backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    stage = tc.pipeline_stage_base()(model, 0, 1, torch.device("cpu"), group=one_rank_group)
    csv = tmp_path / "schedule.csv"
    csv.write_text("0F0,0F1,0B0,0B1\n")
    schedule = tc.csv_schedule(
        [stage], 2, lambda out, target: F.mse_loss(out, target, reduction="sum"), str(csv)
    )
    schedule.step(x, target=y)
    torch.testing.assert_close([p.grad for p in model.parameters()], expected)


def test_loader_workers_shut_down():
    loader = torch.utils.data.DataLoader(list(range(8)), num_workers=1)
    batches = iter(loader)
    next(batches)
    workers = list(batches._workers)
    tc.shutdown_loader_workers(batches)
    assert workers and not any(w.is_alive() for w in workers)
    tc.shutdown_loader_workers(iter(torch.utils.data.DataLoader([1])))  # no workers: nothing to do


def _private_torch_names(source: str) -> list[str]:
    """Private names reached through `torch` in code (comments and strings aside): a dotted
    chain from `torch` with a `_name` link, or an import from torch of a `_name` (a module or
    an attribute). A private attribute of an object held in a variable is not seen."""
    import io
    import tokenize

    code = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type in (tokenize.NAME, tokenize.OP, tokenize.NEWLINE)]  # fmt: skip
    found, chain, statement = [], [], []
    for tok in code:
        if tok.type == tokenize.NEWLINE:
            words = [t.string for t in statement]
            if words[:1] in (["from"], ["import"]) and any(w.startswith("torch") for w in words):
                found += [w for w in words if w.startswith("_") and not w.startswith("__")]
            statement = []
            continue
        statement.append(tok)
        if tok.type == tokenize.NAME and (not chain or chain[-1] == "."):
            chain.append(tok.string)
        elif tok.string == "." and chain and chain[-1] != ".":
            chain.append(".")
        else:
            chain = [tok.string] if tok.type == tokenize.NAME else []
        if chain[:1] == ["torch"] and chain[-1].startswith("_") and not chain[-1].startswith("__"):
            found.append(".".join(c for c in chain if c != "."))
    return found


def test_no_private_torch_name_outside_this_module():
    from conftest import REPO

    files = [REPO / "train.py", *sorted((REPO / "titanlite").rglob("*.py"))]
    found = {
        str(f.relative_to(REPO)): names
        for f in files
        if f.name != "torch_compat.py" and (names := _private_torch_names(f.read_text()))
    }
    assert found == {}, "use titanlite/torch_compat.py for these"
    assert _private_torch_names("import torch.distributed._functional_collectives as f\n")
    assert _private_torch_names("x = torch.cuda.memory._snapshot()\n")
    assert _private_torch_names("from torch.distributed.checkpoint.utils import _view\n")
    assert not _private_torch_names("x = torch.ops.aten.mm  # torch._foo\n")
