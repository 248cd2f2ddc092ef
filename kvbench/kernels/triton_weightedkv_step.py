"""Triton twin of ``weightedkv_step.weightedkv_step``: WeightedKV's whole decode step in one launch.

One program per row (b, h): the protected counts from the budget, the newest position, the lowest a / n of the
mergeable region (one scan), the next position after it (one scan; a row of one tile loads its positions once
for the three), the pairwise merge of two values, and the move of the row's last slot into the merged one. Floating-point contraction is off, so the merge rounds as
the torch reference does.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from kvbench.kernels.triton_slots import (NO_POSITION, block_size, check_storage, fold_lowest, move_last,
                                          newest_position, next_in_tile, next_position, scan_tile)

BLOCK_C = 8192  # slots per tile of a row scan
WARPS = 16
FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)  # the merge key of never-observed slots (after every observed one)
FLOAT32_TINY = tl.constexpr(1.1754943508222875e-38)


@triton.jit
def _average(acc_ptr, obs_ptr, at):
    """a_bar = a / n of the slots ``at`` (0 / 1 where n = 0), rounded as torch divides."""
    return tl.math.div_rn(tl.load(acc_ptr + at), tl.maximum(tl.load(obs_ptr + at), 1.0))


@triton.jit
def _fold_tile(acc_ptr, obs_ptr, start, c, real, pos, sinks, last_free, best, oldest, j):
    """Fold one tile of slots ``c`` (positions ``pos``) of the row at ``start`` into the running lowest merge key
    of the mergeable region (after the sinks, positions up to ``last_free``)."""
    observed = tl.load(obs_ptr + start + c, mask=real, other=0.0)
    average = tl.math.div_rn(tl.load(acc_ptr + start + c, mask=real, other=0.0), tl.maximum(observed, 1.0))
    key = tl.where(observed > 0, average, FLOAT32_MAX)
    return fold_lowest(best, oldest, j, key, pos, c, real & (c >= sinks) & (pos <= last_free))


@triton.jit
def _step_kernel(k_ptr, v_ptr, pos_ptr, len_ptr, state_ptr, acc_ptr, obs_ptr, keep_ptr, H, C, D, DV, S,
                 state_stride, SINKS, RECENT, DERIVED_RECENT: tl.constexpr, ONE_TILE: tl.constexpr,
                 BLOCK_C: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    length = tl.load(len_ptr + row)
    keep = tl.minimum(tl.load(keep_ptr + row // H), length)
    sinks = tl.minimum(tl.minimum(keep, SINKS), keep - 1)  # weightedkv_step.protection
    if DERIVED_RECENT:  # recent=None: the paper's proportion
        wanted = keep // 2 - sinks
    else:
        wanted = keep * 0 + RECENT
    recent = tl.minimum(tl.maximum(wanted, 1), tl.maximum(keep - sinks, 1))
    best = tl.full((), float("inf"), tl.float32)
    oldest = tl.full((), NO_POSITION, tl.int64)
    j = tl.full((), 0, tl.int64)
    if ONE_TILE:  # the row's positions are loaded once for its three scans
        c = tl.arange(0, BLOCK_C)
        real = c < length
        pos = tl.load(pos_ptr + row * C + c, mask=real, other=-1)
        newest = tl.max(pos, 0)
        best, oldest, j = _fold_tile(acc_ptr, obs_ptr, row * C, c, real, pos, sinks, newest - recent, best, oldest,
                                     j)
        following, r = next_in_tile(pos, c, real, tl.load(pos_ptr + row * C + j))
    else:
        newest = newest_position(pos_ptr, row, length, C, BLOCK_C)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            real = c < length
            best, oldest, j = _fold_tile(acc_ptr, obs_ptr, row * C, c, real,
                                         tl.load(pos_ptr + row * C + c, mask=real, other=-1), sinks, newest - recent,
                                         best, oldest, j)
        following, r = next_position(pos_ptr, row, length, tl.load(pos_ptr + row * C + j), C, BLOCK_C)
    w_j = _average(acc_ptr, obs_ptr, row * C + j)
    w_r = _average(acc_ptr, obs_ptr, row * C + r)
    total = w_j + w_r
    f = tl.where(total > 0, tl.math.div_rn(w_j, tl.maximum(total, FLOAT32_TINY)), 0.5)
    dv = tl.arange(0, BLOCK_DV)
    v_j = tl.load(v_ptr + (row * C + j) * DV + dv, mask=dv < DV).to(tl.float32)
    v_r = tl.load(v_ptr + (row * C + r) * DV + dv, mask=dv < DV).to(tl.float32)
    merged = f * v_j + (1 - f) * v_r
    tl.store(v_ptr + (row * C + r) * DV + dv, merged.to(v_ptr.dtype.element_ty),
             mask=dv < tl.where(following < NO_POSITION, DV, 0))  # no next position: nothing merged
    tl.debug_barrier()  # the merged value is written before the move reads the last slot (it may be r)
    move_last(j, row, len_ptr, k_ptr, v_ptr, pos_ptr, state_ptr, C, D, DV, S, state_stride, BLOCK_D, BLOCK_DV,
              BLOCK_S)


def weightedkv_step(keys: Tensor, values: Tensor, positions: Tensor, lengths: Tensor, state: Tensor,
                    accumulated: Tensor, observed: Tensor, n_keep: Tensor, sinks: int, recent: int | None) -> None:
    B, H, C, D = keys.shape
    check_storage(lengths, keys, values, positions, state, accumulated, observed)
    S, DV = state.shape[0], values.shape[-1]
    block_c = scan_tile(C, BLOCK_C)
    _step_kernel[(B * H,)](keys, values, positions, lengths, state, accumulated, observed,
                           n_keep.to(lengths).contiguous(), H, C, D, DV, S, B * H * C, sinks,
                           0 if recent is None else recent, DERIVED_RECENT=recent is None,
                           ONE_TILE=C <= block_c, BLOCK_C=block_c,
                           BLOCK_D=block_size(D), BLOCK_DV=block_size(DV), BLOCK_S=block_size(S), num_warps=WARPS,
                           enable_fp_fusion=False)
