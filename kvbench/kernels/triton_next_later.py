"""Triton twin of ``methods.weightedkv.next_later``: same signature, same result.

One program per (slot tile, b, h) finds, for each slot j of its tile, the first k > j with time[k] > time[j]:
first among the later slots of its own tile, else in the first later tile whose maximum exceeds time[j] (the
tile maxima, one torch reduction, are compared all at once), read in full. Three (tile x tile) comparisons
per program instead of the reference's sparse table and binary lifting (log T passes of several operations).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 128  # slots per tile
CHUNK = 256  # tile maxima compared per step


@triton.jit
def _next_later(time_ptr, tmax_ptr, out_ptr, T, tiles, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    pid_bh = tl.program_id(1)
    tile = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    j = tile * BLOCK + offsets
    row = time_ptr + pid_bh * T
    t_j = tl.load(row + j, mask=j < T, other=0)
    t_k = tl.load(row + j, mask=j < T, other=-1)  # the same tile, as candidates
    later = (j[None, :] > j[:, None]) & (t_k[None, :] > t_j[:, None])
    found = tl.min(tl.where(later, j[None, :], T), 1)
    # the first later tile holding a larger time
    first_tile = tl.full((BLOCK,), 0, tl.int32) + tiles
    for start in range(tile + 1, tiles, CHUNK):
        index = start + tl.arange(0, CHUNK)
        tmax = tl.load(tmax_ptr + pid_bh * tiles + index, mask=index < tiles, other=-1)
        hit = tl.min(tl.where(tmax[None, :] > t_j[:, None], index[None, :], tiles), 1)
        first_tile = tl.minimum(first_tile, hit)
    k = first_tile[:, None] * BLOCK + offsets[None, :]
    t_far = tl.load(row + k, mask=(first_tile[:, None] < tiles) & (k < T), other=-1)
    far = tl.min(tl.where(t_far > t_j[:, None], k, T), 1)
    tl.store(out_ptr + pid_bh * T + j, tl.where(found < T, found, far), mask=j < T)


def next_later(time: Tensor) -> Tensor:
    """Triton ``weightedkv.next_later``: (B, H, T) long -> (B, H, T) long."""
    B, H, T = time.shape
    out = torch.empty_like(time)
    if T:
        tiles = triton.cdiv(T, BLOCK)
        padded = torch.nn.functional.pad(time, (0, tiles * BLOCK - T), value=-1)
        tile_max = padded.view(B, H, tiles, BLOCK).amax(-1).contiguous()
        _next_later[(tiles, B * H)](time.contiguous(), tile_max, out, T, tiles, BLOCK=BLOCK, CHUNK=CHUNK)
    return out
