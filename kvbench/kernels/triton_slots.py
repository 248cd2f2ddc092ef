"""Triton twins of ``slots.select_lowest``, ``slots.move_last_into``, ``slots.evict_lowest`` and
``slots.evict_in_budget``.

``select_lowest`` and ``move_last_into``: one program per row (b, h), which scans the row in tiles (the newest
position, then the lowest unprotected score) or moves the row's last slot (key, value, position, every state)
into the chosen one. The in-place evictions of a decode step (``evict_lowest``: TOVA's; ``evict_in_budget``:
H2O's and StreamingLLM's, the protected counts derived from the budget on the device) split each row over blocks
instead (``row_blocks``), a launch per phase, so that a batch of one fills the device; a step is then two or
three launches per layer instead of a dozen small torch operations. The row operations (``newest_position``,
``lowest_in``, ``next_in``, ``move_last``, ``store_block`` and the folds of blocks' results, ``row_blocks``,
``newest_by_blocks`` and ``lowest_by_blocks``) are also the parts of the merging methods' fused decode steps
(``triton_*_step``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvbench.kernels.triton_decode import multiprocessors

BLOCK_C = 16384  # slots per tile of the scan: a row of up to 16k slots is one vector load per pass
WARPS = 16
NO_POSITION = tl.constexpr(2**63 - 1)  # above every real position
# ``row_blocks`` splits rows until about this many programs per multiprocessor. The split changes no slot's
# arithmetic (a block's best is folded with ties to the oldest position): 8 rather than 4 made EMS's and D2O's
# decode steps of 2 rows x 8 heads about 3 % and 6 % faster on an H200 (twice the programs hide the scans' latency)
PROGRAMS_PER_SM = 8
CPU_PROGRAMS = 8  # the interpreter's stand-in for a device's programs (so that tests cover several blocks)


@triton.jit
def newest_in(pos_ptr, row, length, C, start, stop, BLOCK_C: tl.constexpr):
    """The newest position among one row's slots [start, stop) (-1 when none of them is real)."""
    newest = tl.full((), -1, tl.int64)
    for c0 in range(start, stop, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        pos = tl.load(pos_ptr + row * C + c, mask=(c < length) & (c < stop), other=-1)
        newest = tl.maximum(newest, tl.max(pos, 0))
    return newest


@triton.jit
def newest_position(pos_ptr, row, length, C, BLOCK_C: tl.constexpr):
    """The newest position of one row (-1 when it is empty)."""
    return newest_in(pos_ptr, row, length, C, 0, C, BLOCK_C)


@triton.jit
def fold_lowest(best, oldest, victim, score, pos, c, free):
    """Fold one tile into the running (lowest score, its position, its slot) of the ``free`` slots: ties go to
    the oldest position (slots.select_lowest's rule); no free slot anywhere leaves slot 0."""
    score = tl.where(free, score, float("inf"))
    low = tl.min(score, 0)
    lowest = free & (score == low)
    first = tl.min(tl.where(lowest, pos, NO_POSITION), 0)
    slot = tl.min(tl.where(lowest & (pos == first), c, 2147483647), 0).to(tl.int64)
    better = (low < best) | ((low == best) & (first < oldest))
    return tl.where(better, low, best), tl.where(better, first, oldest), tl.where(better, slot, victim)


@triton.jit
def next_in_tile(pos, c, real, after):
    """(position, slot) of the oldest position after ``after`` among one tile's ``real`` slots ``c`` (positions
    ``pos``); (NO_POSITION, 0) when there is none. One reduction: the key position * 2^24 + slot orders as
    (position, slot) for positions below 2^39 and slots below 2^24 (a row holds far fewer of either)."""
    later = real & (pos > after)
    key = tl.min(tl.where(later, pos * 16777216 + c, NO_POSITION), 0)
    none = key == NO_POSITION
    return tl.where(none, NO_POSITION, key >> 24), tl.where(none, 0, key & 16777215)


@triton.jit
def next_in(pos_ptr, row, length, after, C, start, stop, BLOCK_C: tl.constexpr):
    """(position, slot) of the oldest position after ``after`` among one row's slots [start, stop); (NO_POSITION,
    0) when there is none (slots.next_slots, one at a time)."""
    best = tl.full((), NO_POSITION, tl.int64)
    slot = tl.full((), 0, tl.int64)
    for c0 in range(start, stop, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        real = (c < length) & (c < stop)
        low, at = next_in_tile(tl.load(pos_ptr + row * C + c, mask=real, other=-1), c, real, after)
        slot = tl.where(low < best, at, slot)
        best = tl.minimum(low, best)
    return best, slot


@triton.jit
def droppable(c, pos, real, sinks, recent, newest):
    """Which of slots ``c`` (positions ``pos``) may be dropped: real, from the ``sinks``-th on, their position at
    least ``recent`` before ``newest``."""
    return real & (c >= sinks) & (pos <= newest - recent)


@triton.jit
def lowest_in(score_row, pos_ptr, row, length, sinks, recent, newest, age_sign, C, start, stop,
              BY_SCORE: tl.constexpr, BLOCK_C: tl.constexpr):
    """(lowest score, its position, its slot) among one row's slots [start, stop) that may be dropped: real,
    from the ``sinks``-th on, their position at least ``recent`` before ``newest``; ties to the oldest position;
    (inf, NO_POSITION, 0) when there is none. BY_SCORE: the row's scores at ``score_row`` (its slot 0); else a
    slot's position times ``age_sign`` (StreamingLLM's order)."""
    best = tl.full((), float("inf"), tl.float32)
    oldest = tl.full((), NO_POSITION, tl.int64)  # position of the best slot so far (ties: the oldest wins)
    victim = tl.full((), 0, tl.int64)
    for c0 in range(start, stop, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        real = (c < length) & (c < stop)
        pos = tl.load(pos_ptr + row * C + c, mask=real, other=-1)
        if BY_SCORE:
            score = tl.load(score_row + c, mask=real, other=float("inf")).to(tl.float32)
        else:
            score = (pos * age_sign).to(tl.float32)
        best, oldest, victim = fold_lowest(best, oldest, victim, score, pos, c,
                                           droppable(c, pos, real, sinks, recent, newest))
    return best, oldest, victim


@triton.jit
def lowest_unprotected(score_ptr, pos_ptr, row, length, sinks, recent, newest, age_sign, C,
                       BY_SCORE: tl.constexpr, BLOCK_C: tl.constexpr):
    """The slot to drop in one row (slots.select_lowest): ``lowest_in`` over the whole row."""
    _, _, victim = lowest_in(score_ptr + row * C, pos_ptr, row, length, sinks, recent, newest, age_sign, C, 0, C,
                             BY_SCORE, BLOCK_C)
    return victim


@triton.jit
def fold_highest(best, oldest, match, score, pos, slot, ok):
    """Fold one tile into the running (highest score, its position, its slot) of the ``ok`` slots: ties go to
    the oldest position; no ok slot anywhere leaves (-inf, NO_POSITION, -1)."""
    score = tl.where(ok, score, float("-inf"))
    high = tl.max(score, 0)
    tied = ok & (score == high)
    first = tl.min(tl.where(tied, pos, NO_POSITION), 0)
    at = tl.min(tl.where(tied & (pos == first), slot, 2147483647), 0).to(tl.int64)
    better = (high > best) | ((high == best) & (first < oldest))
    return tl.where(better, high, best), tl.where(better, first, oldest), tl.where(better, at, match)


@triton.jit
def best_of_blocks(score_ptr, pos_ptr, slot_ptr, row, NB, BLOCK_NB: tl.constexpr):
    """(score, slot) of the best of a row's NB block results (each block's ``fold_highest``, stored by a first
    launch at [row * NB + block]): the highest score, ties to the oldest position; slot -1 for none."""
    b = tl.arange(0, BLOCK_NB)
    score = tl.load(score_ptr + row * NB + b, mask=b < NB, other=float("-inf"))
    pos = tl.load(pos_ptr + row * NB + b, mask=b < NB, other=NO_POSITION)
    high = tl.max(score, 0)
    first = tl.min(tl.where(score == high, pos, NO_POSITION), 0)
    slot = tl.min(tl.where((score == high) & (pos == first) & (b < NB),
                           tl.load(slot_ptr + row * NB + b, mask=b < NB, other=-1), NO_POSITION), 0)
    return high, tl.where(high > float("-inf"), slot, -1)


@triton.jit
def _select(score_ptr, len_ptr, pos_ptr, sink_ptr, recent_ptr, row, C, BLOCK_C: tl.constexpr):
    """The slot to drop in one row (see slots.select_lowest)."""
    length = tl.load(len_ptr + row)
    newest = newest_position(pos_ptr, row, length, C, BLOCK_C)
    return lowest_unprotected(score_ptr, pos_ptr, row, length, tl.load(sink_ptr + row), tl.load(recent_ptr + row),
                              newest, 1, C, True, BLOCK_C)


@triton.jit
def move_last(victim, row, len_ptr, k_ptr, v_ptr, pos_ptr, state_ptr, C, D, DV, S, state_stride,
          BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr):
    last = tl.load(len_ptr + row) - 1
    d, dv, s = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_S)
    k = tl.load(k_ptr + (row * C + last) * D + d, mask=d < D)
    tl.store(k_ptr + (row * C + victim) * D + d, k, mask=d < D)
    v = tl.load(v_ptr + (row * C + last) * DV + dv, mask=dv < DV)
    tl.store(v_ptr + (row * C + victim) * DV + dv, v, mask=dv < DV)
    tl.store(pos_ptr + row * C + victim, tl.load(pos_ptr + row * C + last))
    st = tl.load(state_ptr + s * state_stride + row * C + last, mask=s < S)
    tl.store(state_ptr + s * state_stride + row * C + victim, st, mask=s < S)
    tl.store(len_ptr + row, last)


@triton.jit
def budget_rule(keep_ptr, row, H, length, SINKS, RATIO_BITS, HEAVY: tl.constexpr):
    """(sinks, recent, age sign) of one row under its budget keep = min(n_keep, length) (slots.budget_victim):
    H2O's split (``HEAVY``: select.heavy_split of keep, the float64 ratio's bits in ``RATIO_BITS``, the lowest
    score outside sinks and recent window) or StreamingLLM's order (select.eviction_order: the oldest after
    min(keep, SINKS) sinks, the newest when the budget is all sinks)."""
    keep = tl.minimum(tl.load(keep_ptr + row // H), length)
    if HEAVY:  # select.heavy_split, in float64 as there
        ratio = (RATIO_BITS + tl.zeros((), tl.int64)).to(tl.float64, bitcast=True)  # the float64 ratio, exactly
        heavy = tl.floor(ratio * keep.to(tl.float64))
        sinks = tl.minimum(heavy.to(tl.int64), SINKS)
        recent = keep - heavy.to(tl.int64)
        age_sign = 1
    else:  # select.eviction_order: oldest first, newest first when the budget is all sinks
        sinks = tl.minimum(keep, SINKS)
        recent = keep * 0
        age_sign = tl.where(keep - sinks > 0, 1, -1)
    return sinks, recent, age_sign


# The in-place evictions of H2O, StreamingLLM (``evict_in_budget``), TOVA (``evict_lowest``) and CaM
# (``triton_cam_step``) split over blocks of each row's slots, so that a batch of one fills the device: one row's
# scan in one program took 10.7 us a layer at 64k (13k slots, H200)
@triton.jit
def _block_newest_kernel(pos_ptr, len_ptr, newest_ptr, C, span, NB, BLOCK_C: tl.constexpr):
    """Program (row, block): the newest position of the block's slots."""
    row, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    start = block * span
    newest = newest_in(pos_ptr, row, tl.load(len_ptr + row), C, start, tl.minimum(start + span, C), BLOCK_C)
    tl.store(newest_ptr + row * NB + block, newest)


@triton.jit
def _block_lowest_kernel(score_ptr, sb, sh, pos_ptr, len_ptr, keep_ptr, sink_ptr, recent_ptr, newest_ptr, best_ptr,
                         oldest_ptr, slot_ptr, H, C, span, NB, SINKS, RATIO_BITS, BUDGET: tl.constexpr,
                         HEAVY: tl.constexpr, NEWEST_LAST: tl.constexpr, BLOCK_C: tl.constexpr,
                         BLOCK_NB: tl.constexpr):
    """Program (row, block): ``lowest_in`` over the block's slots. BUDGET: under the row's budget
    (``budget_rule``: H2O's split with ``HEAVY``, else StreamingLLM's order), else by score with the row's given
    sinks and recent window (``select_lowest``). The row's newest position is the blocks' (``_block_newest_kernel``)
    where a recent window is protected; StreamingLLM's rule protects none, so every real slot qualifies whatever
    the newest is. Scores of row b * H + h at ``score_ptr + b * sb + h * sh`` (sh = 0: one score row per batch
    row, TOVA's head average). NEWEST_LAST: the row's newest is its last real slot's (``row_newest``)."""
    row, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    length = tl.load(len_ptr + row)
    if BUDGET:
        sinks, recent, age_sign = budget_rule(keep_ptr, row, H, length, SINKS, RATIO_BITS, HEAVY)
    else:
        sinks, recent, age_sign = tl.load(sink_ptr + row), tl.load(recent_ptr + row), 1
    if HEAVY or not BUDGET:
        newest = row_newest(newest_ptr, pos_ptr, row, length, C, NB, NEWEST_LAST, BLOCK_NB)
    else:
        newest = tl.full((), NO_POSITION, tl.int64)
    start = block * span
    best, oldest, slot = lowest_in(score_ptr + (row // H) * sb + (row % H) * sh, pos_ptr, row, length, sinks, recent,
                                   newest, age_sign, C, start, tl.minimum(start + span, C), HEAVY or not BUDGET,
                                   BLOCK_C)
    store_block(best_ptr, oldest_ptr, slot_ptr, row * NB + block, best, oldest, slot)


@triton.jit
def _fold_move_kernel(best_ptr, oldest_ptr, slot_ptr, len_ptr, k_ptr, v_ptr, pos_ptr, state_ptr, C, D, DV, S,
                      state_stride, NB, BLOCK_NB: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                      BLOCK_S: tl.constexpr):
    """Program row: the blocks' lowest folded as one scan of the row folds its tiles (``fold_lowest``: ties to
    the oldest position, then the first slot; no slot anywhere leaves slot 0), then the row's last slot moved
    into it."""
    row = tl.program_id(0).to(tl.int64)
    victim = fold_blocks(best_ptr, oldest_ptr, slot_ptr, row, NB, BLOCK_NB)
    move_last(victim, row, len_ptr, k_ptr, v_ptr, pos_ptr, state_ptr, C, D, DV, S, state_stride, BLOCK_D, BLOCK_DV,
              BLOCK_S)


@triton.jit
def lower_bound(values_ptr, n, key, STEPS: tl.constexpr):
    """The first index i of the ascending ``values_ptr[0:n]`` with a value >= ``key`` (n when there is none, as
    ``torch.searchsorted``): a binary search of ``STEPS`` >= n.bit_length() rounds, for one key or a block of
    keys (every lane its own search; a lane that has found its index reads nothing more)."""
    lo = key * 0
    hi = lo + n
    for _ in range(STEPS):
        searching = lo < hi
        mid = (lo + hi) // 2
        below = tl.load(values_ptr + tl.minimum(mid, n - 1), mask=searching, other=0) < key
        lo = tl.where(searching & below, mid + 1, lo)
        hi = tl.where(searching & ~below, mid, hi)
    return lo


@triton.jit
def newest_of_blocks(newest_ptr, row, NB, BLOCK_NB: tl.constexpr):
    """One row's newest position: the newest of its blocks' (``newest_by_blocks``)."""
    b = tl.arange(0, BLOCK_NB)
    return tl.max(tl.load(newest_ptr + row * NB + b, mask=b < NB, other=-1), 0)


@triton.jit
def last_position(pos_ptr, row, length, C):
    """The position in a row's last real slot, where a one-query pass appended its token (its newest); -1 for an
    empty row."""
    return tl.load(pos_ptr + row * C + tl.maximum(length - 1, 0), mask=length > 0, other=-1)


@triton.jit
def row_newest(newest_ptr, pos_ptr, row, length, C, NB, NEWEST_LAST: tl.constexpr, BLOCK_NB: tl.constexpr):
    """One row's newest position: with NEWEST_LAST its last real slot's (``last_position``; the caller's
    ``newest_last``), else the newest of its blocks'; -1 for an empty row either way."""
    if NEWEST_LAST:
        newest = last_position(pos_ptr, row, length, C)
    else:
        newest = newest_of_blocks(newest_ptr, row, NB, BLOCK_NB)
    return newest


@triton.jit
def store_block(score_ptr, pos_ptr, slot_ptr, at, score, position, slot):
    """A block's result (its best score, that slot's position and index) at ``at`` = row * NB + block, where the
    fold over a row's blocks reads it (``fold_blocks``, ``best_of_blocks``)."""
    tl.store(score_ptr + at, score)
    tl.store(pos_ptr + at, position)
    tl.store(slot_ptr + at, slot)


@triton.jit
def fold_blocks(best_ptr, oldest_ptr, slot_ptr, row, NB, BLOCK_NB: tl.constexpr):
    """The slot one row drops: its blocks' lowest (``_block_lowest_kernel``) folded as one scan of the row folds
    its tiles."""
    b = tl.arange(0, BLOCK_NB)
    block = b < NB
    score = tl.load(best_ptr + row * NB + b, mask=block, other=float("inf"))
    pos = tl.load(oldest_ptr + row * NB + b, mask=block, other=NO_POSITION)
    slot = tl.load(slot_ptr + row * NB + b, mask=block, other=0)
    _, _, victim = fold_lowest(tl.full((), float("inf"), tl.float32), tl.full((), NO_POSITION, tl.int64),
                               tl.full((), 0, tl.int64), score, pos, slot, block)
    return victim


def ratio_bits(ratio: float | None) -> int:
    """The bits of a float64 ratio as an int64 kernel argument (a float argument would be rounded to float32)."""
    return 0 if ratio is None else struct.unpack("<q", struct.pack("<d", ratio))[0]


@triton.jit
def _select_kernel(score_ptr, len_ptr, pos_ptr, sink_ptr, recent_ptr, out_ptr, C, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    tl.store(out_ptr + row, _select(score_ptr, len_ptr, pos_ptr, sink_ptr, recent_ptr, row, C, BLOCK_C))


@triton.jit
def _move_kernel(victim_ptr, len_ptr, k_ptr, v_ptr, pos_ptr, state_ptr, C, D, DV, S, state_stride,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    move_last(tl.load(victim_ptr + row), row, len_ptr, k_ptr, v_ptr, pos_ptr, state_ptr, C, D, DV, S, state_stride,
          BLOCK_D, BLOCK_DV, BLOCK_S)


def scan_tile(n: int, largest: int) -> int:
    """The tile of a scan over n slots or entries: n rounded up to a power of two, within [1024, largest] (one
    compiled variant for every short row: a masked 1024-wide tile costs what a narrower one does)."""
    return min(largest, max(1024, block_size(n)))


def block_size(n: int) -> int:
    return max(2, triton.next_power_of_2(n))


def row_blocks(rows: int, C: int, tile: int, device: torch.device) -> tuple[int, int]:
    """Split each of ``rows`` rows of C slots into blocks of whole tiles, enough to fill the device: (number
    of blocks per row, slots per block). A kernel that reads every key of a row (a best-match search) runs one
    program per (row, block), so that a batch of one still spreads over the multiprocessors."""
    programs = CPU_PROGRAMS if device.type != "cuda" else PROGRAMS_PER_SM * multiprocessors(device)
    wanted = max(1, min(triton.cdiv(programs, rows), triton.cdiv(C, tile)))
    span = triton.cdiv(triton.cdiv(C, wanted), tile) * tile
    return triton.cdiv(C, span), span


def _rows(*tensors: Tensor) -> list[Tensor]:
    """Contiguous per-row tensors (the kernels index rows as b * H + h)."""
    return [t.contiguous() for t in tensors]


def select_lowest(scores: Tensor, lengths: Tensor, positions: Tensor, sinks: Tensor, recent: Tensor) -> Tensor:
    B, H, C = scores.shape
    victim = torch.empty(B, H, dtype=torch.long, device=scores.device)
    scores, positions, sinks, recent = _rows(scores, positions, sinks.expand(B, H), recent.expand(B, H))
    _select_kernel[(B * H,)](scores, lengths, positions, sinks, recent, victim, C, BLOCK_C=min(BLOCK_C, block_size(C)),
                             num_warps=WARPS)
    return victim


def check_storage(*storage: Tensor) -> None:
    """The in-place kernels index rows as (b * H + h) * C + slot: every tensor they write must be contiguous."""
    if not all(t.is_contiguous() for t in storage):
        raise ValueError("in-place slot moves need contiguous storage (the engine's static storage is)")


def move_last_into(victim: Tensor, lengths: Tensor, keys: Tensor, values: Tensor, positions: Tensor,
                   state: Tensor) -> None:
    B, H, C, D = keys.shape
    check_storage(lengths, keys, values, positions, state)
    S = state.shape[0]
    _move_kernel[(B * H,)](victim.contiguous(), lengths, keys, values, positions, state if S else positions,
                           C, D, values.shape[-1], S, B * H * C, BLOCK_D=block_size(D),
                           BLOCK_DV=block_size(values.shape[-1]), BLOCK_S=block_size(S))


BLOCK_SCAN = 1024  # slots per tile of a block's scan (the block-split evictions and decode steps)


def evict_in_budget(scores: Tensor | None, lengths: Tensor, positions: Tensor, n_keep: Tensor, sinks: int,
                    heavy_ratio: float | None, keys: Tensor, values: Tensor, state: Tensor) -> None:
    """H2O's (``heavy_ratio``) and StreamingLLM's step: ``_evict_by_blocks`` under each row's budget."""
    # no per-row sinks or recent window under a budget: ``lengths`` stands in for them, unread
    _evict_by_blocks(positions if scores is None else scores, lengths, positions, keys, values, state,
                     n_keep.to(lengths).contiguous(), lengths, lengths, sinks, heavy_ratio, budget=True)


def evict_lowest(scores: Tensor, lengths: Tensor, positions: Tensor, sinks: Tensor, recent: Tensor,
                 keys: Tensor, values: Tensor, state: Tensor) -> None:
    """TOVA's step: ``_evict_by_blocks`` with each row's given sinks and recent window. Scores may broadcast over
    the heads (stride 0: TOVA's head average is not copied per head)."""
    B, H = lengths.shape
    _evict_by_blocks(scores, lengths, positions, keys, values, state, lengths,  # no budget: ``lengths``, unread
                     *_rows(sinks.expand(B, H), recent.expand(B, H)), 0, None, budget=False)


def _evict_by_blocks(scores: Tensor, lengths: Tensor, positions: Tensor, keys: Tensor, values: Tensor, state: Tensor,
                     n_keep: Tensor, sinks: Tensor, recent: Tensor, budget_sinks: int, heavy_ratio: float | None,
                     budget: bool) -> None:
    """``lowest_by_blocks``, then per row the blocks' fold and the move of its last slot: two or three launches."""
    B, H, C, D = keys.shape
    check_storage(lengths, keys, values, positions, state)
    S = state.shape[0]
    blocks = lowest_by_blocks(scores, lengths, positions, n_keep, sinks, recent, budget_sinks, heavy_ratio, budget,
                              newest=heavy_ratio is not None or not budget)
    _fold_move_kernel[(B * H,)](blocks.best, blocks.oldest, blocks.slot, lengths, keys, values, positions,
                                state if S else positions, C, D, values.shape[-1], S, B * H * C, blocks.count,
                                BLOCK_NB=block_size(blocks.count), BLOCK_D=block_size(D),
                                BLOCK_DV=block_size(values.shape[-1]), BLOCK_S=block_size(S))


@dataclass
class Blocks:
    """Each row's slots split into ``count`` blocks of ``span`` slots, and per block (row * count + block) its
    newest position (where it was wanted; else a stand-in tensor, unread), its lowest score and that slot's
    position and index."""

    count: int
    span: int
    newest: Tensor
    best: Tensor
    oldest: Tensor
    slot: Tensor


def lowest_by_blocks(scores: Tensor, lengths: Tensor, positions: Tensor, n_keep: Tensor, sinks: Tensor,
                     recent: Tensor, budget_sinks: int, heavy_ratio: float | None, budget: bool,
                     newest: bool, newest_last: bool = False) -> Blocks:
    """Each row's slots split over blocks (``row_blocks``): the newest position per block (``newest``: wanted where
    a recent window is protected, or by the caller), then every block's lowest (``_block_lowest_kernel``).
    ``budget``: the protection from ``n_keep`` (B,) (``budget_rule``), else from ``sinks`` and ``recent`` (B, H).
    ``newest_last``: each row's newest position is its last real slot's (``row_newest``): no newest launch, and
    ``Blocks.newest`` is a stand-in."""
    B, H, C = positions.shape
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    rows = B * H
    count, span = row_blocks(rows, C, BLOCK_SCAN, positions.device)
    newest_of = newest_by_blocks(positions, lengths, count, span, wanted=newest and not newest_last)
    oldest, slot = (torch.empty(rows * count, dtype=torch.int64, device=positions.device) for _ in range(2))
    best = torch.empty(rows * count, dtype=torch.float32, device=positions.device)
    _block_lowest_kernel[(rows, count)](scores, scores.stride(0), scores.stride(1), positions, lengths, n_keep, sinks,
                                        recent, newest_of, best, oldest, slot, H, C, span, count, budget_sinks,
                                        ratio_bits(heavy_ratio), BUDGET=budget, HEAVY=heavy_ratio is not None,
                                        NEWEST_LAST=newest_last, BLOCK_C=BLOCK_SCAN, BLOCK_NB=block_size(count))
    return Blocks(count, span, newest_of, best, oldest, slot)


def newest_by_blocks(positions: Tensor, lengths: Tensor, count: int, span: int, wanted: bool = True) -> Tensor:
    """(B * H * count,) the newest position of each block of ``span`` slots of every row (-1: none real). Not
    ``wanted`` (the caller's kernel reads the newest from each row's last slot, or needs none): no launch, and
    ``lengths`` stands in for the tensor argument, unread."""
    if not wanted:
        return lengths
    B, H, C = positions.shape
    newest = torch.empty(B * H * count, dtype=torch.int64, device=positions.device)
    _block_newest_kernel[(B * H, count)](positions, lengths, newest, C, span, count, BLOCK_C=BLOCK_SCAN)
    return newest
