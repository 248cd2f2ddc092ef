"""Triton twin of ``weightedkv_step.weightedkv_step``: WeightedKV's decode step in four launches over blocks of
each row (three with ``newest_last``).

Each row's slots are split over blocks (``triton_slots.row_blocks``), so that a batch of one fills the device: the
newest position per block (unless the caller says the last real slot holds it: ``newest_last``); each block's
lowest a / n of the mergeable region (after the protected counts from the budget); each block's next position after
the slot that merges (the blocks' fold); then per row the next position (the oldest of the blocks'), the pairwise
merge of two values, and the move of the row's last slot into the merged one. One program per row scanning the
whole row three times was latency-bound at a batch of one. The blocks' results fold as one scan's tiles do, so the
slots chosen are the same. Floating-point contraction is off, so the merge rounds as the torch reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvbench.kernels.triton_slots import (BLOCK_SCAN, NO_POSITION, block_size, check_storage, fold_blocks,
                                          fold_lowest, move_last, newest_by_blocks, next_in,
                                          next_in_tile, row_blocks, row_newest, store_block)

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
def _protection(keep_ptr, len_ptr, row, H, SINKS, RECENT, DERIVED_RECENT: tl.constexpr):
    """(sinks, recent) of one row under its budget keep = min(n_keep, length) (``weightedkv_step.protection``)."""
    keep = tl.minimum(tl.load(keep_ptr + row // H), tl.load(len_ptr + row))
    sinks = tl.minimum(tl.minimum(keep, SINKS), keep - 1)
    if DERIVED_RECENT:  # recent=None: the paper's proportion
        wanted = keep // 2 - sinks
    else:
        wanted = keep * 0 + RECENT
    return sinks, tl.minimum(tl.maximum(wanted, 1), tl.maximum(keep - sinks, 1))


@triton.jit
def _lowest_kernel(pos_ptr, len_ptr, acc_ptr, obs_ptr, keep_ptr, newest_ptr, best_ptr, oldest_ptr, slot_ptr, H, C,
                   span, NB, SINKS, RECENT, DERIVED_RECENT: tl.constexpr, NEWEST_LAST: tl.constexpr,
                   BLOCK_C: tl.constexpr, BLOCK_NB: tl.constexpr):
    """Program (row, block): the lowest merge key a / n of the block's mergeable slots (after the sinks, outside
    the recent window of the row's newest position: the blocks' newest, or with NEWEST_LAST the last real
    slot's), ties to the oldest position."""
    row, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    length = tl.load(len_ptr + row)
    sinks, recent = _protection(keep_ptr, len_ptr, row, H, SINKS, RECENT, DERIVED_RECENT)
    newest = row_newest(newest_ptr, pos_ptr, row, length, C, NB, NEWEST_LAST, BLOCK_NB)
    best = tl.full((), float("inf"), tl.float32)
    oldest = tl.full((), NO_POSITION, tl.int64)
    j = tl.full((), 0, tl.int64)
    start = block * span
    stop = tl.minimum(start + span, C)
    for c0 in range(start, stop, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        real = (c < length) & (c < stop)
        best, oldest, j = _fold_tile(acc_ptr, obs_ptr, row * C, c, real,
                                     tl.load(pos_ptr + row * C + c, mask=real, other=-1), sinks, newest - recent,
                                     best, oldest, j)
    store_block(best_ptr, oldest_ptr, slot_ptr, row * NB + block, best, oldest, j)


@triton.jit
def _next_kernel(pos_ptr, len_ptr, best_ptr, oldest_ptr, slot_ptr, next_pos_ptr, next_slot_ptr, C, span, NB,
                 BLOCK_C: tl.constexpr, BLOCK_NB: tl.constexpr):
    """Program (row, block): the slot that merges (the blocks' fold), then the oldest position after it among the
    block's slots ((NO_POSITION, 0) if none)."""
    row, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    after = tl.load(pos_ptr + row * C + fold_blocks(best_ptr, oldest_ptr, slot_ptr, row, NB, BLOCK_NB))
    start = block * span
    following, r = next_in(pos_ptr, row, tl.load(len_ptr + row), after, C, start, tl.minimum(start + span, C),
                           BLOCK_C)
    tl.store(next_pos_ptr + row * NB + block, following)
    tl.store(next_slot_ptr + row * NB + block, r)


@triton.jit
def _merge_kernel(k_ptr, v_ptr, pos_ptr, len_ptr, state_ptr, acc_ptr, obs_ptr, best_ptr, oldest_ptr, slot_ptr,
                  next_pos_ptr, next_slot_ptr, C, D, DV, S, state_stride, NB, BLOCK_NB: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program row: the slot j that merges, the next position r after it (the oldest of the blocks'), the pairwise
    merge of their values into r, and the move of the row's last slot into j."""
    row = tl.program_id(0).to(tl.int64)
    j = fold_blocks(best_ptr, oldest_ptr, slot_ptr, row, NB, BLOCK_NB)
    b = tl.arange(0, BLOCK_NB)
    cpos = tl.load(next_pos_ptr + row * NB + b, mask=b < NB, other=NO_POSITION)
    candidate = cpos < NO_POSITION  # a block with no later position offers none
    following, r = next_in_tile(cpos, tl.load(next_slot_ptr + row * NB + b, mask=candidate, other=0), candidate,
                                tl.load(pos_ptr + row * C + j))
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
                    accumulated: Tensor, observed: Tensor, n_keep: Tensor, sinks: int, recent: int | None,
                    newest_last: bool = False) -> None:
    B, H, C, D = keys.shape
    check_storage(lengths, keys, values, positions, state, accumulated, observed)
    S, DV, rows = state.shape[0], values.shape[-1], B * H
    NB, span = row_blocks(rows, C, BLOCK_SCAN, keys.device)
    newest = newest_by_blocks(positions, lengths, NB, span, wanted=not newest_last)
    oldest, slot, next_pos, next_slot = (torch.empty(rows * NB, dtype=torch.int64, device=keys.device)
                                         for _ in range(4))
    best = torch.empty(rows * NB, dtype=torch.float32, device=keys.device)
    _lowest_kernel[(rows, NB)](positions, lengths, accumulated, observed, n_keep.to(lengths).contiguous(), newest,
                               best, oldest, slot, H, C, span, NB, sinks, 0 if recent is None else recent,
                               DERIVED_RECENT=recent is None, NEWEST_LAST=newest_last, BLOCK_C=BLOCK_SCAN,
                               BLOCK_NB=block_size(NB))
    _next_kernel[(rows, NB)](positions, lengths, best, oldest, slot, next_pos, next_slot, C, span, NB,
                             BLOCK_C=BLOCK_SCAN, BLOCK_NB=block_size(NB))
    _merge_kernel[(rows,)](keys, values, positions, lengths, state, accumulated, observed, best, oldest, slot,
                           next_pos, next_slot, C, D, DV, S, rows * C, NB, BLOCK_NB=block_size(NB),
                           BLOCK_D=block_size(D), BLOCK_DV=block_size(DV), BLOCK_S=block_size(S),
                           enable_fp_fusion=False)
