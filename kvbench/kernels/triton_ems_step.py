"""Triton twins of ``ems_step.ems_step`` (EMS's decode step in three to five launches) and of
``ems_step.ems_observe`` (one launch: the longest query count of the row, then every slot's scores).

Like D2O's step (``triton_d2o_step``), the redundancy of the TBM token with every centre reads every raw key
and value of the row, so it is split over blocks of slots:
1. grid (rows,): the row's Global-Local score ratio and TBM token (scans of the positions and the three score
   states, 20 bytes a slot), once per row;
2. grid (rows, blocks): the best redundancy of the TBM token among each block's centres (ties: the oldest
   position); with a look-up table, each block also scans its share of the row's entries (the first free one,
   the oldest member, t's members);
3. grid (rows,): the best of the row's blocks, the merge decision, the weighted merge of two keys (unit raw
   directions rotated to the centre's position, ``rotate_like``'s rule) and two values, the merge state, the
   entry the new member takes (from the blocks' scans), and the move of the row's last slot into the TBM token's;
4. grid (rows, blocks), with a look-up table: t's members follow it or leave, and t takes its planned entry.
Three launches rather than two: with the TBM token found inside phase 2, each of its programs (hundreds per
row at batch 1) rescanned the row's four per-slot arrays to do ~C / blocks redundancies, ~100 us a layer on an
H100 at 6.5k slots against a launch's few microseconds. The table's pass is split over the blocks too: one
program per row scanning ~20k entries took 26 us a layer at 32k on an H200, a quarter of the step's own kernels.
Raw keys come in, or (``raw_keys=None``, 16-bit keys) phases 2 and 3 take RoPE off the stored keys of the slots
they read in registers (``_raw_halves``), rounded as ``attention.unrotate_keys`` rounds them: a decode step then
never writes and reads an un-RoPE'd copy of the whole cache. Phase 2 reads cos and sin from the model's table
(``Rope.table``) and is launched a second time for the blocks that read a position past it, which compute them.
On an H200 (Llama-3.1-8B shape, bf16, one layer's whole step, each way at its best tile): 66 us with the table at
1 row x 6,554 slots and 149 us at 8 x 3,277; computing cos and sin for every slot 78 and 186 us (register spills);
one kernel holding both ways 78 and 195 us; raw keys given 56 and 123 us, after a copy un-RoPE'd by torch (about
26 us a layer at 1 x 6,554) (``results/gpu/2026-11-27/logs/ems_rope_source_call34.md``).
Floating-point contraction is off in phase 3; row sums, norms and cosines round differently from torch (float32
units in the last place: a cosine is the unit TBM key's dot product with a key divided by that key's norm, where
torch divides every element first, as ``triton_d2o_step`` does), which moves a merge decision only when R sits
within that of tau or of another centre's R.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvbench.kernels.redundancy import SIMILARITIES
from kvbench.kernels.triton_decode import INTERPRETED
from kvbench.kernels.triton_slots import (NO_POSITION, best_of_blocks, block_size, check_storage, fold_highest,
                                          fold_lowest, move_last, newest_position, ratio_bits, row_blocks, scan_tile,
                                          store_block)

if TYPE_CHECKING:
    from kvbench.attention import Rope

BLOCK_C = 8192  # slots per tile of a row scan
BLOCK_S = 32  # slots per tile of the redundancy scan
BLOCK_E = 1024  # look-up-table entries per tile (a row's table is split over the same blocks as its slots)
WARPS = 8
REDUNDANCY_WARPS = 4  # at 1 x 8 x 6,555 and 32 x 8 x 3,277 slots on an H200, 4 warps ran 10-20 % faster than 8
SCAN_WARPS = 16  # the TBM token's scans: one program per row, a whole tile of the row per load
EPS = tl.constexpr(1e-12)  # F.normalize's
REL_EPS = tl.constexpr(1e-4)  # rotate_like's
INTERPRETED_ROUNDING = tl.constexpr(INTERPRETED)  # _rounded's bfloat16 rounding on the bits


@triton.jit
def _tbm_token(pos_ptr, len_ptr, keep_ptr, glo_ptr, past_ptr, cur_ptr, row, H, C, WINDOW, BLOCK_C: tl.constexpr):
    """(TBM slot, the row's score ratio mean(s_Loc) / mean(s_Glo), the newest position outside the local
    window): the lowest score outside the window, ties to the newest position."""
    length = tl.load(len_ptr + row)
    keep = tl.minimum(tl.load(keep_ptr + row // H), length)
    newest = newest_position(pos_ptr, row, length, C, BLOCK_C)
    total_glo = tl.full((), 0.0, tl.float32)
    total_loc = tl.full((), 0.0, tl.float32)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        real = c < length
        total_glo += tl.sum(tl.load(glo_ptr + row * C + c, mask=real, other=0.0), 0)
        total_loc += tl.sum(tl.load(past_ptr + row * C + c, mask=real, other=0.0)
                            + tl.load(cur_ptr + row * C + c, mask=real, other=0.0), 0)
    ratio = tl.where(total_glo > 0, tl.math.div_rn(total_loc, tl.maximum(total_glo, 1e-30)), 0.0)
    n_loc = tl.minimum(keep, WINDOW)
    best = tl.full((), float("inf"), tl.float32)
    newest_first = tl.full((), NO_POSITION, tl.int64)  # -position of the best slot so far
    t = tl.full((), 0, tl.int64)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        real = c < length
        pos = tl.load(pos_ptr + row * C + c, mask=real, other=-1)
        score = _score(glo_ptr, past_ptr, cur_ptr, row * C + c, real, ratio)
        candidate = real & (pos <= newest - n_loc)
        best, newest_first, t = fold_lowest(best, newest_first, t, score, -pos, c, candidate)  # ties: newest
    return t, ratio, newest - n_loc


@triton.jit
def _score(glo_ptr, past_ptr, cur_ptr, at, real, ratio):
    """ems_step.global_local_score of the slots ``at`` given the row's ratio."""
    s_glo = tl.load(glo_ptr + at, mask=real, other=0.0)
    s_loc = tl.load(past_ptr + at, mask=real, other=0.0) + tl.load(cur_ptr + at, mask=real, other=0.0)
    return tl.maximum(s_glo * ratio, s_loc)


@triton.jit
def _unit(x):
    """F.normalize of one vector (masked lanes hold 0)."""
    return tl.math.div_rn(x, tl.maximum(tl.sqrt_rn(tl.sum(x * x, 0)), EPS))


@triton.jit
def _tbm_kernel(pos_ptr, len_ptr, keep_ptr, glo_ptr, past_ptr, cur_ptr, t_ptr, ratio_ptr, outside_ptr, H, C,
                WINDOW, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t, ratio, outside = _tbm_token(pos_ptr, len_ptr, keep_ptr, glo_ptr, past_ptr, cur_ptr, row, H, C, WINDOW,
                                   BLOCK_C)
    tl.store(t_ptr + row, t)
    tl.store(ratio_ptr + row, ratio)
    tl.store(outside_ptr + row, outside)


@triton.jit
def _redundancy_kernel(raw_ptr, v_ptr, pos_ptr, len_ptr, t_ptr, outside_ptr, r_ptr, at_pos_ptr, at_slot_ptr,
                       cos_ptr, sin_ptr, inv_freq_ptr, TABLE_ROWS, SCALING, past_ptr, lut_pos_ptr, lut_centre_ptr,
                       lut_part_ptr, E, E_SPAN, C, D: tl.constexpr, DV: tl.constexpr, SPAN, NB,
                       SIMILARITY: tl.constexpr, UNROTATE: tl.constexpr, FIXUP: tl.constexpr, TABLE: tl.constexpr,
                       BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_E: tl.constexpr):
    """Phase 2. Unrotating, cos and sin come from the model's table, and a block that reads a position past it is
    marked (``past_ptr``); the same launch with ``FIXUP`` then redoes the marked blocks alone with cos and sin
    computed (one kernel holding both ways spilled registers and ran slower than either)."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    rope = (cos_ptr, sin_ptr, inv_freq_ptr)
    if FIXUP:
        if tl.load(past_ptr + row * NB + block) != 0:
            best, oldest, match, _ = _block_redundancy(raw_ptr, v_ptr, pos_ptr, len_ptr, t_ptr, outside_ptr, rope,
                                                       TABLE_ROWS, SCALING, row, block, C, D, DV, SPAN, SIMILARITY,
                                                       UNROTATE, False, BLOCK_S, BLOCK_H, BLOCK_DV)
            store_block(r_ptr, at_pos_ptr, at_slot_ptr, row * NB + block, best, oldest, match)
    else:
        best, oldest, match, past = _block_redundancy(raw_ptr, v_ptr, pos_ptr, len_ptr, t_ptr, outside_ptr, rope,
                                                      TABLE_ROWS, SCALING, row, block, C, D, DV, SPAN, SIMILARITY,
                                                      UNROTATE, UNROTATE, BLOCK_S, BLOCK_H, BLOCK_DV)
        if UNROTATE:
            tl.store(past_ptr + row * NB + block, past.to(tl.int32))
        if TABLE:
            _scan_lut(lut_pos_ptr, lut_centre_ptr, lut_part_ptr, row, block, NB, E, E_SPAN,
                      tl.load(pos_ptr + row * C + tl.load(t_ptr + row)), BLOCK_E)
        store_block(r_ptr, at_pos_ptr, at_slot_ptr, row * NB + block, best, oldest, match)


@triton.jit
def _block_redundancy(raw_ptr, v_ptr, pos_ptr, len_ptr, t_ptr, outside_ptr, rope_ptrs, TABLE_ROWS, SCALING, row,
                      block, C, D: tl.constexpr, DV: tl.constexpr, SPAN, SIMILARITY: tl.constexpr,
                      UNROTATE: tl.constexpr, FROM_TABLE: tl.constexpr, BLOCK_S: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The best redundancy of the row's TBM token among one block's centres: (R, its position, its slot), and
    (``FROM_TABLE``) whether a position read lies past the RoPE table."""
    t = tl.load(t_ptr + row)
    outside = tl.load(outside_ptr + row)
    length = tl.load(len_ptr + row)
    HALF = D // 2
    h = tl.arange(0, BLOCK_H)
    dv = tl.arange(0, BLOCK_DV)
    p_t = tl.load(pos_ptr + row * C + t)
    past = p_t >= TABLE_ROWS
    if SIMILARITY != 2:
        t1, t2 = _raw_halves(raw_ptr + (row * C + t) * D + h, raw_ptr + (row * C + t) * D + HALF + h, h < HALF,
                             p_t, rope_ptrs, h, HALF, TABLE_ROWS, SCALING, UNROTATE, FROM_TABLE)
        norm_t = tl.maximum(tl.sqrt_rn(tl.sum(t1 * t1, 0) + tl.sum(t2 * t2, 0)), EPS)
        t1 = tl.math.div_rn(t1, norm_t)
        t2 = tl.math.div_rn(t2, norm_t)
    value_t = _unit(tl.load(v_ptr + (row * C + t) * DV + dv, mask=dv < DV, other=0.0).to(tl.float32))
    best = tl.full((), float("-inf"), tl.float32)
    oldest = tl.full((), NO_POSITION, tl.int64)
    match = tl.full((), -1, tl.int64)
    for s0 in range(block * SPAN, block * SPAN + SPAN, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        real = s < length
        pos = tl.load(pos_ptr + row * C + s, mask=real, other=NO_POSITION)
        centre = real & (pos <= outside) & (s != t)
        R = tl.full((BLOCK_S,), 1.0, tl.float32)
        if SIMILARITY != 2:  # the key factor (key_value, key), on unit raw keys
            at = (row * C + s[:, None]) * D + h[None, :]
            k1, k2 = _raw_halves(raw_ptr + at, raw_ptr + at + HALF, centre[:, None] & (h[None, :] < HALF),
                                 pos[:, None], rope_ptrs, h[None, :], HALF, TABLE_ROWS, SCALING, UNROTATE,
                                 FROM_TABLE)
            past = past | (tl.max(tl.where(centre, pos, 0), 0) >= TABLE_ROWS)
            norm = tl.maximum(tl.sqrt_rn(tl.sum(k1 * k1, 1) + tl.sum(k2 * k2, 1)), EPS)
            # each cosine is the dot product divided by the norm, not every element divided first (torch's unit
            # keys): two IEEE divisions a slot instead of D + D_v, which made this launch compute-bound at a batch
            R = tl.maximum(tl.math.div_rn(tl.sum(t1[None, :] * k1, 1) + tl.sum(t2[None, :] * k2, 1), norm), 0.0)
        if SIMILARITY != 1:  # the value factor (key_value, value)
            values = tl.load(v_ptr + (row * C + s[:, None]) * DV + dv[None, :],
                             mask=centre[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
            norm = tl.maximum(tl.sqrt_rn(tl.sum(values * values, 1)), EPS)
            R = R * tl.maximum(tl.math.div_rn(tl.sum(value_t[None, :] * values, 1), norm), 0.0)
        best, oldest, match = fold_highest(best, oldest, match, R, pos, s, centre)
    return best, oldest, match, past


@triton.jit
def _raw_halves(first_ptr, second_ptr, mask, position, rope_ptrs, h, HALF, TABLE_ROWS, SCALING,
                UNROTATE: tl.constexpr, FROM_TABLE: tl.constexpr):
    """The two halves (i, i + D/2) of raw keys as float32: loaded (raw keys given), or (``UNROTATE``) the stored
    keys' with RoPE taken off in registers as ``attention.unrotate_keys`` does it, each product and the difference
    rounded to the keys' dtype as torch rounds them. cos and sin: ``FROM_TABLE``, the model's own (``Rope.table``;
    ``rope_ptrs``: its cos and sin, ``TABLE_ROWS`` positions, then the frequencies; a position past the table reads
    its last row, which the caller marks), else computed as the rotary embedding computes them (``Rope.frequencies``;
    float32 ``tl.cos`` and ``tl.sin`` are libdevice's, as torch's on CUDA). ``h``: the half-dimension index."""
    x1 = tl.load(first_ptr, mask=mask, other=0.0)
    x2 = tl.load(second_ptr, mask=mask, other=0.0)
    if UNROTATE:
        BF16: tl.constexpr = x1.dtype == tl.bfloat16
        cos_ptr, sin_ptr, inv_freq_ptr = rope_ptrs
        p = tl.maximum(position, 0)
        if FROM_TABLE:
            p = tl.minimum(p, TABLE_ROWS - 1)
            cos = tl.load(cos_ptr + p * HALF + h, mask=mask, other=0.0).to(tl.float32)
            sin = tl.load(sin_ptr + p * HALF + h, mask=mask, other=0.0).to(tl.float32)
        else:
            angle = p.to(tl.float32) * tl.load(inv_freq_ptr + h, mask=mask, other=0.0)
            cos = _rounded(tl.cos(angle) * SCALING, BF16)
            sin = _rounded(tl.sin(angle) * SCALING, BF16)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        return (_rounded(_rounded(f1 * cos, BF16) - _rounded(-f2 * sin, BF16), BF16),
                _rounded(_rounded(f2 * cos, BF16) - _rounded(f1 * sin, BF16), BF16))
    return x1.to(tl.float32), x2.to(tl.float32)


@triton.jit
def _rounded(x, BF16: tl.constexpr):
    """float32 ``x`` rounded to bfloat16 (``BF16``) or float16, to nearest even, as float32. Compiled, a cast
    (one conversion instruction, which rounds as torch does); interpreted, the bfloat16 rounding is done on the
    bits, because Triton's interpreter truncates in its bfloat16 casts. Compiled, the bit form (five integer
    operations, six times a key element pair) made the redundancy launch 1.4x as long at 32 rows x 8 heads x 3,277
    slots on an H200."""
    if BF16:
        if INTERPRETED_ROUNDING:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        return x.to(tl.bfloat16).to(tl.float32)
    return x.to(tl.float16).to(tl.float32)


@triton.jit
def _halves(ptr, HALF, BLOCK_H: tl.constexpr):
    """The two halves (i, i + D/2) of one vector, as float32."""
    h = tl.arange(0, BLOCK_H)
    return (tl.load(ptr + h, mask=h < HALF, other=0.0).to(tl.float32),
            tl.load(ptr + HALF + h, mask=h < HALF, other=0.0).to(tl.float32))


@triton.jit
def _rotate_like(x1, x2, r1, r2, p1, p2):
    """redundancy.rotate_like: x rotated as RoPE took the raw key (halves r1, r2) to the key (halves p1, p2)."""
    cos = p1 * r1 + p2 * r2
    sin = p2 * r1 - p1 * r2
    scale = tl.maximum(tl.sqrt_rn(cos * cos + sin * sin), 1e-30)
    usable = tl.sqrt_rn(r1 * r1 + r2 * r2) > REL_EPS * tl.sqrt_rn(tl.sum(r1 * r1, 0) + tl.sum(r2 * r2, 0))
    cos = tl.where(usable, tl.math.div_rn(cos, scale), 1.0)
    sin = tl.where(usable, tl.math.div_rn(sin, scale), 0.0)
    return x1 * cos - x2 * sin, x1 * sin + x2 * cos


@triton.jit
def _merge_kernel(k_ptr, raw_ptr, v_ptr, pos_ptr, len_ptr, state_ptr, keep_ptr, glo_ptr, past_ptr, cur_ptr,
                  mass_ptr, tokens_ptr, bias_ptr, lut_part_ptr, lut_plan_ptr, lut_norm_plan_ptr, t_ptr, ratio_ptr,
                  r_ptr, at_pos_ptr, at_slot_ptr, cos_ptr, sin_ptr, inv_freq_ptr, TABLE_ROWS, SCALING, H, C,
                  D: tl.constexpr, DV: tl.constexpr, S, state_stride, E, NB, TAU, GAMMA_BITS, TBM_ALWAYS: tl.constexpr,
                  LUT: tl.constexpr, TABLE: tl.constexpr, WITH_POSITIONS: tl.constexpr, BIAS: tl.constexpr,
                  UNROTATE: tl.constexpr, BLOCK_NB: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(t_ptr + row)
    ratio = tl.load(ratio_ptr + row)
    best, d = best_of_blocks(r_ptr, at_pos_ptr, at_slot_ptr, row, NB, BLOCK_NB)
    keep = tl.minimum(tl.load(keep_ptr + row // H), tl.load(len_ptr + row))
    if TBM_ALWAYS:
        tbm = keep >= 0
    else:  # ems_step.tbm_share, in float64 as there
        gamma_1 = (GAMMA_BITS + tl.zeros((), tl.int64)).to(tl.float64, bitcast=True)
        tbm = tl.floor(gamma_1 * keep.to(tl.float64) + 0.5) >= 1
    merged = tbm & (best >= TAU) & (d >= 0)
    d = tl.maximum(d, 0)
    real = t >= 0  # a scalar True, for the masked score loads
    score_t = _score(glo_ptr, past_ptr, cur_ptr, row * C + t, real, ratio)
    score_d = _score(glo_ptr, past_ptr, cur_ptr, row * C + d, real, ratio)
    w_t = score_t + tl.load(mass_ptr + row * C + t)
    w_d = score_d + tl.load(mass_ptr + row * C + d)
    mass = w_t + w_d
    f_t = tl.where(mass > 0, tl.math.div_rn(w_t, tl.maximum(mass, 1e-30)), 0.5)
    f_d = tl.where(mass > 0, tl.math.div_rn(w_d, tl.maximum(mass, 1e-30)), 0.5)
    # keys (ems_step._merge): the unit raw directions' weighted sum, renormalised, rotated to d's position
    HALF = D // 2
    h = tl.arange(0, BLOCK_H)
    rope = (cos_ptr, sin_ptr, inv_freq_ptr)
    t1, t2 = _raw_halves(raw_ptr + (row * C + t) * D + h, raw_ptr + (row * C + t) * D + HALF + h, h < HALF,
                         tl.load(pos_ptr + row * C + t), rope, h, HALF, TABLE_ROWS, SCALING, UNROTATE, False)
    d1, d2 = _raw_halves(raw_ptr + (row * C + d) * D + h, raw_ptr + (row * C + d) * D + HALF + h, h < HALF,
                         tl.load(pos_ptr + row * C + d), rope, h, HALF, TABLE_ROWS, SCALING, UNROTATE, False)
    norm_raw_t = tl.maximum(tl.sqrt_rn(tl.sum(t1 * t1, 0) + tl.sum(t2 * t2, 0)), EPS)
    norm_raw_d = tl.maximum(tl.sqrt_rn(tl.sum(d1 * d1, 0) + tl.sum(d2 * d2, 0)), EPS)
    s1 = tl.math.div_rn(d1, norm_raw_d) * f_d + tl.math.div_rn(t1, norm_raw_t) * f_t
    s2 = tl.math.div_rn(d2, norm_raw_d) * f_d + tl.math.div_rn(t2, norm_raw_t) * f_t
    norm_s = tl.maximum(tl.sqrt_rn(tl.sum(s1 * s1, 0) + tl.sum(s2 * s2, 0)), EPS)
    s1 = tl.math.div_rn(s1, norm_s)
    s2 = tl.math.div_rn(s2, norm_s)
    kt1, kt2 = _halves(k_ptr + (row * C + t) * D, HALF, BLOCK_H)
    norm_t = tl.sqrt_rn(tl.sum(kt1 * kt1, 0) + tl.sum(kt2 * kt2, 0))
    kd1, kd2 = _halves(k_ptr + (row * C + d) * D, HALF, BLOCK_H)
    norm_d = tl.sqrt_rn(tl.sum(kd1 * kd1, 0) + tl.sum(kd2 * kd2, 0))
    o1, o2 = _rotate_like(s1, s2, d1, d2, kd1, kd2)
    if LUT:
        o1, o2 = o1 * norm_d, o2 * norm_d
    elif WITH_POSITIONS:  # each member expanded at its own position
        m1, m2 = _rotate_like(s1, s2, t1, t2, kt1, kt2)
        o1, o2 = o1 * norm_d * f_d + m1 * norm_t * f_t, o2 * norm_d * f_d + m2 * norm_t * f_t
    else:
        norm = norm_d * f_d + norm_t * f_t
        o1, o2 = o1 * norm, o2 * norm
    into = h < tl.where(merged, HALF, 0)
    tl.store(k_ptr + (row * C + d) * D + h, o1.to(k_ptr.dtype.element_ty), mask=into)
    tl.store(k_ptr + (row * C + d) * D + HALF + h, o2.to(k_ptr.dtype.element_ty), mask=into)
    dv = tl.arange(0, BLOCK_DV)
    v_d = tl.load(v_ptr + (row * C + d) * DV + dv, mask=dv < DV).to(tl.float32)
    v_t = tl.load(v_ptr + (row * C + t) * DV + dv, mask=dv < DV).to(tl.float32)
    tl.store(v_ptr + (row * C + d) * DV + dv, (v_d * f_d + v_t * f_t).to(v_ptr.dtype.element_ty),
             mask=dv < tl.where(merged, DV, 0))
    tokens = tl.load(tokens_ptr + row * C + t) + 1 + tl.load(tokens_ptr + row * C + d) + 1
    tl.store(mass_ptr + row * C + d, mass - score_d, mask=merged)
    tl.store(tokens_ptr + row * C + d, tokens - 1, mask=merged)
    if BIAS:
        tl.store(bias_ptr + row * C + d, tl.log(tl.maximum(tokens, 1.0)), mask=merged)
    if TABLE:
        _plan_lut(lut_part_ptr, lut_plan_ptr, lut_norm_plan_ptr, row, NB, E, tl.load(pos_ptr + row * C + t),
                  tl.load(pos_ptr + row * C + d), norm_t, merged, BLOCK_NB)
    tl.debug_barrier()  # the merge is written before the move reads the last slot (it may be d)
    move_last(t, row, len_ptr, k_ptr, v_ptr, pos_ptr, state_ptr, C, D, DV, S, state_stride, BLOCK_D, BLOCK_DV,
              BLOCK_S)


BIG_ENTRY = tl.constexpr(2147483647)  # past every entry


@triton.jit
def _fold_oldest(oldest, entry, position, e, live):
    """Fold entries ``e`` into the running (oldest position, its entry) of the ``live`` ones (ties: the lowest entry)."""
    low = tl.min(tl.where(live, position, NO_POSITION), 0)
    at = tl.min(tl.where(live & (position == low), e, BIG_ENTRY), 0).to(tl.int64)
    better = (low < oldest) | ((low == oldest) & (at < entry))
    return tl.where(better, low, oldest), tl.where(better, at, entry)


@triton.jit
def _scan_lut(pos_ptr, centre_ptr, part_ptr, row, block, NB, E, E_SPAN, p_t, BLOCK_E: tl.constexpr):
    """Phase 2's share of ems_step._update_lut: over one block of the row's entries, as they are before the step,
    the first free entry, the first entry of t's members, and the oldest (position, entry) among the other live
    entries and among t's members; stored at part[row, block, 0:6] for phase 3 to decide."""
    first_free = tl.full((), BIG_ENTRY, tl.int64)
    first_t = tl.full((), BIG_ENTRY, tl.int64)
    oldest, oldest_entry = tl.full((), NO_POSITION, tl.int64), tl.full((), BIG_ENTRY, tl.int64)
    oldest_t, oldest_t_entry = tl.full((), NO_POSITION, tl.int64), tl.full((), BIG_ENTRY, tl.int64)
    for e0 in range(block * E_SPAN, block * E_SPAN + E_SPAN, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        inside = e < E
        position = tl.load(pos_ptr + row * E + e, mask=inside, other=-1)
        of_t = inside & (tl.load(centre_ptr + row * E + e, mask=inside, other=-1) == p_t)
        first_free = tl.minimum(first_free, tl.min(tl.where(inside & (position < 0), e, BIG_ENTRY), 0).to(tl.int64))
        first_t = tl.minimum(first_t, tl.min(tl.where(of_t, e, BIG_ENTRY), 0).to(tl.int64))
        live = inside & (position >= 0)
        oldest, oldest_entry = _fold_oldest(oldest, oldest_entry, position, e, live & ~of_t)
        oldest_t, oldest_t_entry = _fold_oldest(oldest_t, oldest_t_entry, position, e, live & of_t)
    at = part_ptr + (row * NB + block) * 6
    tl.store(at, first_free)
    tl.store(at + 1, first_t)
    tl.store(at + 2, oldest)
    tl.store(at + 3, oldest_entry)
    tl.store(at + 4, oldest_t)
    tl.store(at + 5, oldest_t_entry)


@triton.jit
def _plan_lut(part_ptr, plan_ptr, norm_plan_ptr, row, NB, E, p_t, p_d, norm_t, merged, BLOCK_NB: tl.constexpr):
    """Phase 3's share of ems_step._update_lut: from the blocks' scans, where t joins d's cluster as a member (the
    first free entry, t's own entries counting as free when t leaves for the zero class; else the oldest member's,
    if t is newer); stored at plan[row] = (merged, p_t, p_d, entry, insert) and norm_plan[row] = ||k_t||."""
    b = tl.arange(0, BLOCK_NB)
    at = part_ptr + (row * NB + b) * 6
    inside = b < NB
    first_free = tl.min(tl.load(at, mask=inside, other=BIG_ENTRY), 0)
    first_t = tl.min(tl.load(at + 1, mask=inside, other=BIG_ENTRY), 0)
    first_free = tl.where(merged, first_free, tl.minimum(first_free, first_t))
    oldest, oldest_entry = _fold_oldest(tl.full((), NO_POSITION, tl.int64), tl.full((), BIG_ENTRY, tl.int64),
                                        tl.load(at + 2, mask=inside, other=NO_POSITION),
                                        tl.load(at + 3, mask=inside, other=BIG_ENTRY), inside)
    oldest_t, oldest_t_entry = _fold_oldest(oldest, oldest_entry, tl.load(at + 4, mask=inside, other=NO_POSITION),
                                            tl.load(at + 5, mask=inside, other=BIG_ENTRY), inside)
    oldest = tl.where(merged, oldest_t, oldest)  # t's members stay in the table only if t merges
    oldest_entry = tl.where(merged, oldest_t_entry, oldest_entry)
    has_free = first_free < E
    insert = merged & (has_free | (p_t > oldest))
    tl.store(plan_ptr + row * 5, merged.to(tl.int64))
    tl.store(plan_ptr + row * 5 + 1, p_t)
    tl.store(plan_ptr + row * 5 + 2, p_d)
    tl.store(plan_ptr + row * 5 + 3, tl.where(has_free, first_free, oldest_entry))
    tl.store(plan_ptr + row * 5 + 4, insert.to(tl.int64))
    tl.store(norm_plan_ptr + row, norm_t)


@triton.jit
def _lut_kernel(pos_ptr, centre_ptr, norm_ptr, plan_ptr, norm_plan_ptr, E, E_SPAN, BLOCK_E: tl.constexpr):
    """Phase 4, grid (rows, blocks): ems_step._update_lut's writes over one block of a row's entries: t's members
    follow it into d's cluster or leave with it, then t takes the planned entry (a block's own)."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    merged = tl.load(plan_ptr + row * 5) != 0
    p_t = tl.load(plan_ptr + row * 5 + 1)
    p_d = tl.load(plan_ptr + row * 5 + 2)
    entry = tl.load(plan_ptr + row * 5 + 3)
    insert = tl.load(plan_ptr + row * 5 + 4) != 0
    for e0 in range(block * E_SPAN, block * E_SPAN + E_SPAN, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        inside = e < E
        of_t = inside & (tl.load(centre_ptr + row * E + e, mask=inside, other=-1) == p_t)
        tl.store(centre_ptr + row * E + e, tl.where(merged, p_d, -1) + tl.zeros_like(e).to(tl.int64), mask=of_t)
        freed = of_t & (e < tl.where(merged, -1, E))  # zero class: t's members leave with it
        tl.store(pos_ptr + row * E + e, tl.full((BLOCK_E,), -1, tl.int64), mask=freed)
        tl.store(norm_ptr + row * E + e, tl.full((BLOCK_E,), -1.0, tl.float32), mask=freed)
    tl.debug_barrier()  # the block's re-pointing is written before t takes its entry (which may be one of them)
    mine = insert & (entry >= block * E_SPAN) & (entry < block * E_SPAN + E_SPAN)
    tl.store(pos_ptr + row * E + entry, p_t, mask=mine)
    tl.store(centre_ptr + row * E + entry, p_d, mask=mine)
    tl.store(norm_ptr + row * E + entry, tl.load(norm_plan_ptr + row), mask=mine)


@triton.jit
def _observe_kernel(glo_ptr, past_ptr, cur_ptr, queries_ptr, att_ptr, len_ptr, C, WINDOW, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    length = tl.load(len_ptr + row)
    queries = tl.full((), float("-inf"), tl.float32)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        queries = tl.maximum(queries, tl.max(tl.load(queries_ptr + row * C + c, mask=c < C,
                                                     other=float("-inf")), 0))
    queries += 1
    rolled = queries >= WINDOW
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        at = row * C + c
        inside = c < C
        step = tl.where(c < length, tl.load(att_ptr + at, mask=inside, other=0.0), 0.0)
        tl.store(glo_ptr + at, tl.load(glo_ptr + at, mask=inside) + step, mask=inside)
        cur = tl.load(cur_ptr + at, mask=inside) + step
        tl.store(past_ptr + at, tl.where(rolled, cur, tl.load(past_ptr + at, mask=inside)), mask=inside)
        tl.store(cur_ptr + at, tl.where(rolled, 0.0, cur), mask=inside)
        tl.store(queries_ptr + at, tl.where(c < length, tl.where(rolled, 0.0, queries), 0.0), mask=inside)


def ems_observe(s_glo: Tensor, s_loc_past: Tensor, s_loc_cur: Tensor, s_loc_cur_queries: Tensor,
                attention: Tensor, lengths: Tensor, window: int) -> None:
    B, H, C = attention.shape
    check_storage(s_glo, s_loc_past, s_loc_cur, s_loc_cur_queries, attention, lengths)
    _observe_kernel[(B * H,)](s_glo, s_loc_past, s_loc_cur, s_loc_cur_queries, attention, lengths, C, window,
                              BLOCK_C=scan_tile(C, BLOCK_C), num_warps=WARPS)


def ems_step(keys: Tensor, values: Tensor, positions: Tensor, lengths: Tensor, state: Tensor,
             raw_keys: Tensor | None, scores: tuple[Tensor, Tensor, Tensor],
             merges: tuple[Tensor, Tensor, Tensor | None], lut: tuple[Tensor, Tensor, Tensor] | None, n_keep: Tensor,
             window: int, tau: float, gamma: float, similarity: str, with_positions: bool,
             rope: Rope | None = None) -> None:
    B, H, C, D = keys.shape
    merged_mass, merged_tokens, logit_bias = merges
    tables = lut if lut is not None else (positions, positions, merged_mass)  # unused stand-ins
    # raw keys in registers where the kernels can round them as torch does (16-bit keys: the products are exact)
    unrotate = raw_keys is None and rope.frequencies is not None and keys.dtype in (torch.bfloat16, torch.float16)
    if raw_keys is None and not unrotate:
        raw_keys = rope.unrotate(keys, positions)
    inv_freq, scaling = rope.frequencies if unrotate else (merged_mass, 1.0)  # stand-in pointers
    cos, sin = rope.table(keys.dtype) if unrotate else (merged_mass, merged_mass)
    rope_args = (cos, sin, inv_freq, cos.shape[0] if unrotate else 0, scaling)
    raw = keys if unrotate else raw_keys
    check_storage(lengths, keys, values, positions, state, raw, *scores, merged_mass, merged_tokens, *tables)
    S, DV, rows, E = state.shape[0], values.shape[-1], B * H, tables[0].shape[-1] if lut is not None else 0
    NB, span = row_blocks(rows, C, BLOCK_S, keys.device)
    n_keep = n_keep.to(lengths).contiguous()
    t, outside = (torch.empty(rows, dtype=torch.long, device=keys.device) for _ in range(2))
    ratio = torch.empty(rows, dtype=torch.float32, device=keys.device)
    R = torch.empty(rows, NB, dtype=torch.float32, device=keys.device)
    at_position, at_slot = (torch.empty(rows, NB, dtype=torch.long, device=keys.device) for _ in range(2))
    table = E > 0
    E_SPAN = triton.cdiv(triton.cdiv(max(E, 1), NB), BLOCK_E) * BLOCK_E
    lut_part = torch.empty(rows, NB, 6, dtype=torch.long, device=keys.device) if table else at_position
    lut_plan = torch.empty(rows, 5, dtype=torch.long, device=keys.device) if table else at_position
    lut_norm = torch.empty(rows, dtype=torch.float32, device=keys.device) if table else ratio
    past = torch.empty(rows, NB, dtype=torch.int32, device=keys.device) if unrotate else outside
    _tbm_kernel[(rows,)](positions, lengths, n_keep, *scores, t, ratio, outside, H, C, window,
                         BLOCK_C=scan_tile(C, BLOCK_C), num_warps=SCAN_WARPS)
    for fixup in (False, True) if unrotate else (False,):
        _redundancy_kernel[(rows, NB)](raw, values, positions, lengths, t, outside, R, at_position, at_slot,
                                       *rope_args, past, tables[0], tables[1], lut_part, E, E_SPAN, C, D, DV, span,
                                       NB, SIMILARITY=SIMILARITIES.index(similarity), UNROTATE=unrotate, FIXUP=fixup,
                                       TABLE=table, BLOCK_S=BLOCK_S, BLOCK_H=block_size(D // 2),
                                       BLOCK_DV=block_size(DV), BLOCK_E=BLOCK_E,
                                       num_warps=REDUNDANCY_WARPS)
    gamma_bits = ratio_bits(None if math.isinf(gamma) else gamma - 1)
    _merge_kernel[(rows,)](keys, raw, values, positions, lengths, state, n_keep, *scores, merged_mass,
                           merged_tokens, merged_mass if logit_bias is None else logit_bias, lut_part, lut_plan,
                           lut_norm, t, ratio, R, at_position, at_slot, *rope_args, H, C, D, DV, S, B * H * C, E, NB,
                           tau, gamma_bits, TBM_ALWAYS=math.isinf(gamma), LUT=lut is not None, TABLE=table,
                           WITH_POSITIONS=with_positions, BIAS=logit_bias is not None, UNROTATE=unrotate,
                           BLOCK_NB=block_size(NB), BLOCK_H=block_size(D // 2), BLOCK_DV=block_size(DV),
                           BLOCK_D=block_size(D), BLOCK_S=block_size(S), num_warps=WARPS, enable_fp_fusion=False)
    if table:
        _lut_kernel[(rows, NB)](*tables, lut_plan, lut_norm, E, E_SPAN, BLOCK_E=BLOCK_E, num_warps=WARPS)
