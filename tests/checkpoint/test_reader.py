"""titanlite.checkpoint.reader: DirectReader loads exactly what DCP's FileSystemReader loads, reads
the tensors it can into their destinations itself, and names a truncated file."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_nested_equal
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from titanlite.checkpoint.reader import DirectReader
from titanlite.checkpoint.stream import single_process_quietly


def saved_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(8, 6, generator=g),
        "half": torch.randn(5, 3, generator=g).bfloat16(),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "ints": torch.randint(0, 1000, (7,), generator=g),
        "blob": b"dataloader position",
    }


def blank(state: dict) -> dict:
    return {k: torch.full_like(v, -1) if torch.is_tensor(v) else b"" for k, v in state.items()}


@pytest.fixture
def ckpt(tmp_path):
    state = saved_state()
    with single_process_quietly():
        dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    return tmp_path, state


@pytest.fixture
def fallbacks(monkeypatch):
    """The items DirectReader hands to FileSystemReader's own path."""
    handed = []
    stock = FileSystemReader.read_data

    def recording(self, plan, planner):
        handed.extend(item.dest_index.fqn for item in plan.items)
        return stock(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", recording)
    return handed


def load(state: dict, reader) -> dict:
    with single_process_quietly():
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def test_loads_every_tensor_in_place_and_only_byte_blobs_through_dcp(ckpt, fallbacks):
    path, state = ckpt
    dest = blank(state)
    weights = dest["w"]
    loaded = load(dest, DirectReader(str(path)))
    assert_nested_equal(loaded, state)
    assert loaded["w"] is weights  # filled, not replaced
    assert fallbacks == ["blob"]


def test_another_dtype_or_a_strided_destination_loads_as_dcp_loads_it(ckpt, fallbacks):
    path, state = ckpt
    dest = blank(state)
    dest["w"] = torch.zeros(6, 8).t()  # not contiguous: read into host memory, then copied
    dest["half"] = torch.zeros(5, 3, dtype=torch.float64)  # cast by the copy, as DCP casts it
    load(dest, DirectReader(str(path)))
    assert fallbacks == ["blob"]
    stock = blank(state)
    stock["w"], stock["half"] = torch.zeros(6, 8).t(), torch.zeros(5, 3, dtype=torch.float64)
    assert_nested_equal(dest, load(stock, FileSystemReader(str(path))))
    assert torch.equal(dest["w"], state["w"])


def read_rows_or_columns(path, dim: int) -> tuple[torch.Tensor, list]:
    """Rows 4-7 (dim 0) or columns 3-5 (dim 1) of the stored 8 x 6 "w", as a resharded load
    asks for a slice of a stored chunk."""
    part = torch.full((4, 6) if dim == 0 else (8, 3), -1.0)
    offsets = [4, 0] if dim == 0 else [0, 3]
    reader = DirectReader(str(path))
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, is_coordinator=True)
    planner = DefaultLoadPlanner()
    planner.set_up_planner({"w": part}, metadata, is_coordinator=True)
    item = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("w", [0, 0]),
        dest_offsets=torch.Size([0, 0]),
        storage_index=MetadataIndex("w", [0, 0]),
        storage_offsets=torch.Size(offsets),
        lengths=part.shape,
    )
    reader.read_data(LoadPlan([item]), planner).wait()
    return part


def test_a_slice_of_a_stored_tensor_reads_from_its_offset(ckpt, fallbacks):
    path, state = ckpt
    assert torch.equal(read_rows_or_columns(path, dim=0), state["w"][4:])
    assert fallbacks == []  # contiguous in the file: read directly at its byte offset
    assert torch.equal(read_rows_or_columns(path, dim=1), state["w"][:, 3:])
    assert fallbacks == ["w"]  # strided in the file: DCP's own path


def test_a_truncated_file_is_named_as_truncated(ckpt):
    path, state = ckpt
    (data,) = path.glob("*.distcp")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointException, match="the checkpoint is truncated"):
        load(blank(state), DirectReader(str(path)))
