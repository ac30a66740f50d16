"""Random init that any part of a tensor can produce alone, with the values of the whole.

A tensor's values are drawn in fixed tiles of TILE_ROWS x TILE_COLS, each from its own generator
seeded by (seed, parameter name, tile index). A rank that holds rows 1000-1099 and columns 0-511 of
a sharded weight draws only the tiles that cover them, yet gets the very values a single process
draws for the whole tensor: every layout starts from the same weights, and init costs each rank its
shard, not the model. Values depend on the device type's generator (CPU and CUDA differ).
"""

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn

# Small enough that a shard rarely draws much it does not keep (405B on 512 GPUs: an FSDP shard of
# w1 is 104 rows; TP=8 gives 512-column shards of the 4096-wide 8B), large enough that the per-tile
# cost (seeding, a few kernels) is small next to drawing 8192 values.
TILE_ROWS, TILE_COLS = 16, 512


@dataclass(frozen=True)
class ParamInit:
    """How one parameter is drawn: N(0, std^2), cut to [-bound, bound] when bound is set;
    or every element `constant` (norm scales)."""

    std: float = 1.0
    bound: float | None = None
    constant: float | None = None


def _param_seed(seed: int, key: str) -> int:
    """A 62-bit seed per (run seed, parameter name); tiles add their index to it."""
    digest = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def _as_2d(shape) -> tuple[int, int]:
    if len(shape) == 1:
        return 1, shape[0]
    assert len(shape) == 2, f"tiled init handles 1-D and 2-D parameters, not {tuple(shape)}"
    return tuple(shape)


def _draw(tile: torch.Tensor, init: ParamInit, gen: torch.Generator) -> torch.Tensor:
    """Draw `tile` in place (contiguous: torch's CPU normal_ draws other values into a strided
    tensor)."""
    if init.bound is None:
        return tile.normal_(0.0, init.std, generator=gen)  # nn.init.normal_'s own call
    return nn.init.trunc_normal_(tile, std=init.std, a=-init.bound, b=init.bound, generator=gen)


def _tiles(start: int, length: int, tile: int, total: int):
    """(tile index, tile start, tile end) of the tiles covering [start, start + length)."""
    for i in range(start // tile, math.ceil((start + length) / tile)):
        yield i, i * tile, min((i + 1) * tile, total)


@torch.no_grad()
def fill_(local: torch.Tensor, init: ParamInit, *, seed: int, key: str, global_shape, offset=None):
    """Fill `local` with its region of the tensor `key` of `global_shape` that starts at `offset`
    (per dimension; None = the whole tensor). 1-D tensors are one row."""
    if init.constant is not None:
        local.fill_(init.constant)
        return
    rows, cols = _as_2d(global_shape)
    r0, c0 = (0, 0) if offset is None else (0, offset[0]) if len(offset) == 1 else offset
    view = local.view(_as_2d(local.shape))
    h, w = view.shape
    base, col_tiles = _param_seed(seed, key), math.ceil(cols / TILE_COLS)
    gen = torch.Generator(device=local.device)
    # One buffer per tile shape, reused, and no nn.init wrapper per tile: an 8B shard is ~10^5
    # tiles, and on a 2-core CPU those took 41-49 us a tile where seeding, drawing and copying
    # take 29 (33-41 us now).
    buffers: dict[tuple[int, int], torch.Tensor] = {}
    for i, ta, tb in _tiles(r0, h, TILE_ROWS, rows):
        for j, sa, sb in _tiles(c0, w, TILE_COLS, cols):
            gen.manual_seed((base + i * col_tiles + j) % 2**63)
            shape = (tb - ta, sb - sa)
            if shape not in buffers:
                buffers[shape] = torch.empty(shape, dtype=torch.float32, device=local.device)
            tile = _draw(buffers[shape], init, gen)
            ra, rb, ca, cb = max(ta, r0), min(tb, r0 + h), max(sa, c0), min(sb, c0 + w)
            view[ra - r0 : rb - r0, ca - c0 : cb - c0] = tile[ra - ta : rb - ta, ca - sa : cb - sa]
