"""Triton twin of ``cam_step.cam_step``: CaM's whole decode step in one launch.

One program per row (b, h): the protected counts from the budget, the newest position, the evicted slot (one
scan), its n next positions (n reductions for the next older position, held in a (n,) vector; a row of one
tile is loaded once for all n, longer rows are rescanned for each), the merge probability and the counter-based draw (``cam_step.uniform_draws`` bit for bit:
integer hashing on int64), the (n, DV) tile of target values, and the move of the row's last slot into the
evicted one. Floating-point contraction is off, so the merge rounds as the torch reference does; only the sum
of the n targets' attention may round differently (a tree instead of torch's order).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from kvbench.kernels.triton_slots import (NO_POSITION, block_size, budget_victim, check_storage, move_last,
                                          next_in_tile, next_position, ratio_bits, scan_tile)

BLOCK_C = 8192  # slots per tile of a row scan
WARPS = 16
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
def _step_kernel(k_ptr, v_ptr, pos_ptr, len_ptr, state_ptr, att_ptr, keep_ptr, H, C, D, DV, S, state_stride,
                 SINKS, RATIO_BITS, KEY, N, HEAVY: tl.constexpr, DRAW: tl.constexpr, ONE_TILE: tl.constexpr,
                 BLOCK_C: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    length = tl.load(len_ptr + row)
    victim, newest = budget_victim(att_ptr, pos_ptr, len_ptr, keep_ptr, row, H, C, SINKS, RATIO_BITS, HEAVY, BLOCK_C)
    evicted = tl.load(pos_ptr + row * C + victim)
    # the n next positions, oldest first: targets (n,) slots, found (n,) whether each exists
    n = tl.arange(0, BLOCK_N)
    targets = tl.zeros((BLOCK_N,), tl.int64)
    found = n < 0
    after = evicted
    c = tl.arange(0, BLOCK_C)
    if ONE_TILE:  # the row's positions stay in registers for the n reductions
        pos = tl.load(pos_ptr + row * C + c, mask=c < length, other=-1)
    for i in range(N):
        if ONE_TILE:
            after, slot = next_in_tile(pos, c, c < length, after)
        else:
            after, slot = next_position(pos_ptr, row, length, after, C, BLOCK_C)
        targets = tl.where(n == i, slot, targets)
        found = found | (n == tl.where(after < NO_POSITION, i, -1))
    total = tl.sum(tl.load(att_ptr + row * C + targets, mask=found, other=0.0), 0)
    count = tl.sum(found.to(tl.int32), 0)
    score = tl.load(att_ptr + row * C + victim)
    prob = merge_probability(score, total, count)
    if DRAW:
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
             n_keep: Tensor, sinks: int, heavy_ratio: float | None, merge_tokens: int, key: int | None) -> None:
    B, H, C, D = keys.shape
    check_storage(lengths, keys, values, positions, state, attention)
    S, DV = state.shape[0], values.shape[-1]
    block_c = scan_tile(C, BLOCK_C)
    _step_kernel[(B * H,)](keys, values, positions, lengths, state, attention, n_keep.to(lengths).contiguous(),
                           H, C, D, DV, S, B * H * C, sinks, ratio_bits(heavy_ratio), 0 if key is None else key,
                           merge_tokens,
                           HEAVY=heavy_ratio is not None, DRAW=key is not None, ONE_TILE=C <= block_c,
                           BLOCK_C=block_c, BLOCK_N=block_size(merge_tokens),
                           BLOCK_D=block_size(D), BLOCK_DV=block_size(DV), BLOCK_S=block_size(S), num_warps=WARPS,
                           enable_fp_fusion=False)
