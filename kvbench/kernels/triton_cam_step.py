"""Triton twin of ``cam_step.cam_step``: CaM's decode step in three or four launches over blocks of each row.

Each row's slots are split over blocks (``triton_slots.lowest_by_blocks``), so that a batch of one fills the
device: the newest position per block (for H2O's recent window and the draw; not with ``newest_last``), then
each block's lowest under the budget (the protected counts derived from it); ``_next_kernel``, per block, the n
oldest positions after the evicted one among its slots; ``_merge_kernel``, per row, the n next positions (the
oldest n of the blocks'), the merge probability and the counter-based draw (``cam_step.uniform_draws`` bit for
bit: integer hashing on int64), the (n, DV) tile of target values, and the move of the row's last slot into the
evicted one. One program per row scanning the whole row took most of CaM's step at 64k (n = 16 rescans of a row
longer than a tile). The blocks' results fold as one scan's tiles do, so the slots chosen are the same.
Floating-point contraction is off, so the merge rounds as the torch reference does; only the sum of the n targets'
attention may round differently (a tree instead of torch's order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvbench.kernels.triton_slots import (NO_POSITION, block_size, check_storage, fold_blocks, lowest_by_blocks,
                                          move_last, next_in, next_in_tile, row_newest)

BLOCK_C = 8192  # the largest block ``_next_kernel`` holds in registers for its n reductions
WARPS = 16  # ``_next_kernel``'s warps for blocks over 2,048 slots
NEXT_WARPS = 2  # ``_next_kernel``'s warps for blocks up to 2,048 slots (against 4: 25 vs 27.5 us a layer, 512 rows)
# ``_merge_kernel``'s: one row's (n, DV) tile and one slot's move are small (7.4 against 10.4 and 16.9 us a layer
# with 8 and 16 warps, 512 rows x 3,277 slots, H200)
MERGE_WARPS = 4
INT32_MAX = tl.constexpr(2147483647)
FLOAT32_TINY = tl.constexpr(1.1754943508222875e-38)


@triton.jit
def _mix32(x):
    """cam_step.mix32 on int64 values in [0, 2^32)."""
    mask = tl.full((), 0xFFFFFFFF, tl.int64)
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & mask
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & mask
    return x ^ (x >> 15)


@triton.jit
def uniform_draw(key, head, position, step):
    """cam_step.uniform_draws on int64 values (a slot or a tile of slots)."""
    mask = tl.full((), 0xFFFFFFFF, tl.int64)
    x = _mix32((key + tl.zeros((), tl.int64)) ^ head)
    x = _mix32(x ^ (position & mask))
    x = _mix32(x ^ (step & mask))
    return (x >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2^-24


@triton.jit
def merge_probability(score, total, count):
    """cam_step.merge_probability (a slot or a tile of slots), IEEE-rounded divisions: bit for bit."""
    mean = tl.math.div_rn(total, tl.maximum(count, 1).to(tl.float32))
    ratio = tl.where(mean > 0, tl.math.div_rn(score, tl.maximum(mean, FLOAT32_TINY)), (score > 0).to(tl.float32))
    return tl.where(count > 0, tl.minimum(tl.maximum(ratio, 0.0), 1.0), 0.0)


@triton.jit
def _next_kernel(pos_ptr, len_ptr, best_ptr, oldest_ptr, slot_ptr, next_pos_ptr, next_slot_ptr, C, span, NB, N,
                 ONE_TILE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_NB: tl.constexpr):
    """Program (row, block): the evicted slot (the blocks' fold), then the n oldest positions after it among the
    block's slots, oldest first ((NO_POSITION, 0) past the last). A block of one tile is loaded once for all n and
    searched in int32: a row's positions are distinct (a slot holds one token) and below 2^31 - 1, so the next
    position is one int32 minimum, and the slot holding the i-th is the one with i older positions among those
    found (counted elementwise as they are found, then scattered): n int32 reductions instead of n over an int64
    (position, slot) key."""
    row, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    length = tl.load(len_ptr + row)
    after = tl.load(pos_ptr + row * C + fold_blocks(best_ptr, oldest_ptr, slot_ptr, row, NB, BLOCK_NB))
    start = block * span
    stop = tl.minimum(start + span, C)
    c = start + tl.arange(0, BLOCK_C)
    real = (c < length) & (c < stop)
    out = (row * NB + block) * N
    if ONE_TILE:
        pos = tl.load(pos_ptr + row * C + c, mask=real, other=-1).to(tl.int32)
        later = real & (pos > after.to(tl.int32))
        rank = tl.zeros((BLOCK_C,), tl.int32)  # per slot, how many of the positions found so far are older
        next32 = after.to(tl.int32)
        for i in range(N):
            next32 = tl.min(tl.where(later & (pos > next32), pos, INT32_MAX), 0)
            rank += (pos > next32).to(tl.int32)
            none = next32 == INT32_MAX
            tl.store(next_pos_ptr + out + i, tl.where(none, NO_POSITION, next32.to(tl.int64)))
            tl.store(next_slot_ptr + out + i, 0, mask=none)
        # the slot holding the i-th next position has rank i: one scatter instead of a search per position
        tl.store(next_slot_ptr + out + rank, c.to(tl.int64), mask=later & (rank < N))
    else:
        for i in range(N):
            after, at = next_in(pos_ptr, row, length, after, C, start, stop, BLOCK_C)
            tl.store(next_pos_ptr + out + i, after)
            tl.store(next_slot_ptr + out + i, at)


@triton.jit
def _merge_kernel(k_ptr, v_ptr, pos_ptr, len_ptr, state_ptr, att_ptr, newest_ptr, best_ptr, oldest_ptr, slot_ptr,
                  next_pos_ptr, next_slot_ptr, H, C, D, DV, S, state_stride, KEY, N, NB, DRAW: tl.constexpr,
                  NEWEST_LAST: tl.constexpr, BLOCK_NB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program row: the evicted slot; its n next positions, the oldest n of the blocks' (n reductions over the
    n * NB candidates, held once); the merge probability and the counter-based draw (``cam_step.uniform_draws``
    bit for bit: integer hashing on int64, the row's newest position being the blocks' newest, or with NEWEST_LAST
    its last real slot's); the (n, DV) tile of target values; and the move of the row's last slot into the evicted
    one."""
    row = tl.program_id(0).to(tl.int64)
    victim = fold_blocks(best_ptr, oldest_ptr, slot_ptr, row, NB, BLOCK_NB)
    evicted = tl.load(pos_ptr + row * C + victim)
    m = tl.arange(0, BLOCK_M)
    candidate = m < NB * N
    cpos = tl.load(next_pos_ptr + row * NB * N + m, mask=candidate, other=NO_POSITION)
    cslot = tl.load(next_slot_ptr + row * NB * N + m, mask=candidate, other=0)
    candidate = candidate & (cpos < NO_POSITION)
    # the n next positions, oldest first: targets (n,) slots, found (n,) whether each exists
    n = tl.arange(0, BLOCK_N)
    targets = tl.zeros((BLOCK_N,), tl.int64)
    found = n < 0
    after = evicted
    for i in range(N):
        after, slot = next_in_tile(cpos, cslot, candidate, after)
        targets = tl.where(n == i, slot, targets)
        found = found | (n == tl.where(after < NO_POSITION, i, -1))
    total = tl.sum(tl.load(att_ptr + row * C + targets, mask=found, other=0.0), 0)
    count = tl.sum(found.to(tl.int32), 0)
    score = tl.load(att_ptr + row * C + victim)
    prob = merge_probability(score, total, count)
    if DRAW:
        newest = row_newest(newest_ptr, pos_ptr, row, tl.load(len_ptr + row), C, NB, NEWEST_LAST, BLOCK_NB)
        prob = (uniform_draw(KEY, row % H, evicted, newest) < prob).to(tl.float32)
    share = tl.math.div_rn(prob, N + tl.zeros((), tl.float32))
    dv = tl.arange(0, BLOCK_DV)
    x_e = tl.load(v_ptr + (row * C + victim) * DV + dv, mask=dv < DV).to(tl.float32)
    at = v_ptr + (row * C + targets[:, None]) * DV + dv[None, :]
    into = found[:, None] & (dv[None, :] < DV)
    received = tl.load(at, mask=into, other=0.0).to(tl.float32) + x_e[None, :] * share
    tl.store(at, received.to(v_ptr.dtype.element_ty), mask=into)
    tl.debug_barrier()  # the targets are written before the move reads the last slot (it may be one of them)
    move_last(victim, row, len_ptr, k_ptr, v_ptr, pos_ptr, state_ptr, C, D, DV, S, state_stride, BLOCK_D,
              BLOCK_DV, BLOCK_S)


def cam_step(keys: Tensor, values: Tensor, positions: Tensor, lengths: Tensor, state: Tensor, attention: Tensor,
             n_keep: Tensor, sinks: int, heavy_ratio: float | None, merge_tokens: int, key: int | None,
             newest_last: bool = False) -> None:
    B, H, C, D = keys.shape
    check_storage(lengths, keys, values, positions, state, attention)
    S, DV, rows, N = state.shape[0], values.shape[-1], B * H, merge_tokens
    blocks = lowest_by_blocks(attention, lengths, positions, n_keep.to(lengths).contiguous(), lengths, lengths, sinks,
                              heavy_ratio, budget=True, newest=heavy_ratio is not None or key is not None,
                              newest_last=newest_last)
    NB = blocks.count
    next_pos, next_slot = (torch.empty(rows * NB * N, dtype=torch.int64, device=keys.device) for _ in range(2))
    tile = block_size(blocks.span)
    _next_kernel[(rows, NB)](positions, lengths, blocks.best, blocks.oldest, blocks.slot, next_pos, next_slot, C,
                             blocks.span, NB, N, ONE_TILE=tile <= BLOCK_C, BLOCK_C=min(tile, BLOCK_C),
                             BLOCK_NB=block_size(NB), num_warps=NEXT_WARPS if tile <= 2048 else WARPS)
    _merge_kernel[(rows,)](keys, values, positions, lengths, state, attention, blocks.newest, blocks.best,
                           blocks.oldest, blocks.slot, next_pos, next_slot, H, C, D, DV, S, rows * C,
                           0 if key is None else key, N, NB, DRAW=key is not None, NEWEST_LAST=newest_last,
                           BLOCK_NB=block_size(NB), BLOCK_M=block_size(NB * N), BLOCK_N=block_size(N),
                           BLOCK_D=block_size(D), BLOCK_DV=block_size(DV), BLOCK_S=block_size(S),
                           num_warps=MERGE_WARPS, enable_fp_fusion=False)
