"""Tiled init: any region drawn alone equals that region of the whole tensor, at the cost of the
region (plus the tiles its edges cut), with the asked-for distribution."""

import pytest
import torch

from titanlite.models import tiled_init
from titanlite.models.tiled_init import TILE_COLS, TILE_ROWS, ParamInit, fill_

INIT = ParamInit(std=0.02, bound=0.04)
SHAPE = (3 * TILE_ROWS + 5, 2 * TILE_COLS + 7)  # edge tiles are partial


def whole(shape=SHAPE, init=INIT, seed=1, key="w"):
    t = torch.empty(shape)
    fill_(t, init, seed=seed, key=key, global_shape=shape)
    return t


@pytest.mark.parametrize(
    "rows,cols",
    [
        ((0, SHAPE[0]), (0, SHAPE[1])),
        ((7, 29), (0, SHAPE[1])),  # an FSDP row shard across a tile edge
        ((0, SHAPE[0]), (300, 700)),  # a TP column shard
        ((TILE_ROWS, 2 * TILE_ROWS), (TILE_COLS, 2 * TILE_COLS)),  # exactly one tile
        ((SHAPE[0] - 1, SHAPE[0]), (SHAPE[1] - 3, SHAPE[1])),  # the corner
        ((5, 5), (0, SHAPE[1])),  # an empty shard (uneven FSDP)
    ],
)
def test_region_alone_equals_region_of_whole(rows, cols):
    (r0, r1), (c0, c1) = rows, cols
    part = torch.full((r1 - r0, c1 - c0), float("nan"))
    fill_(part, INIT, seed=1, key="w", global_shape=SHAPE, offset=(r0, c0))
    assert torch.equal(part, whole()[r0:r1, c0:c1])


def test_one_dimensional_shards():
    shape, init = (1000,), ParamInit(std=1.0)
    full = whole(shape, init)
    part = torch.empty(300)
    fill_(part, init, seed=1, key="w", global_shape=shape, offset=(600,))
    assert torch.equal(part, full[600:900])


def test_draws_only_the_tiles_covering_the_region(monkeypatch):
    drawn = []
    real_draw = tiled_init._draw
    monkeypatch.setattr(
        tiled_init, "_draw", lambda tile, *a: drawn.append(tuple(tile.shape)) or real_draw(tile, *a)
    )
    shape = (64 * TILE_ROWS, 8 * TILE_COLS)
    fill_(torch.empty(TILE_ROWS, TILE_COLS * 2), INIT, seed=1, key="w", global_shape=shape,
          offset=(5 * TILE_ROWS, 2 * TILE_COLS))  # fmt: skip
    assert drawn == [(TILE_ROWS, TILE_COLS)] * 2
    drawn.clear()
    # A row shard off the tile grid draws the two tiles its rows straddle, per tile column.
    fill_(torch.empty(TILE_ROWS, shape[1]), INIT, seed=1, key="w", global_shape=shape,
          offset=(TILE_ROWS // 2, 0))  # fmt: skip
    assert len(drawn) == 2 * 8


def test_seed_and_name_select_the_stream():
    base = whole()
    assert not torch.equal(base, whole(seed=2))
    assert not torch.equal(base, whole(key="v"))
    # Tiles of one tensor are not copies of each other.
    assert not torch.equal(
        base[:TILE_ROWS, :TILE_COLS], base[TILE_ROWS : 2 * TILE_ROWS, :TILE_COLS]
    )


def test_distribution():
    t = whole((256, 1024), ParamInit(std=0.5, bound=1.0))
    assert t.abs().max().item() <= 1.0
    assert t.mean().item() == pytest.approx(0.0, abs=0.01)
    # N(0, 0.25) cut at 2 sigma has std 0.5 * 0.880.
    assert t.std().item() == pytest.approx(0.5 * 0.880, rel=0.02)
    normal = whole((256, 1024), ParamInit(std=2.0))
    assert normal.std().item() == pytest.approx(2.0, rel=0.02)
    assert torch.equal(whole((7,), ParamInit(constant=1.0)), torch.ones(7))
