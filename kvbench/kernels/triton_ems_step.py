"""Triton twins of ``ems_step.ems_step`` (EMS's decode step in three launches, look-up table included) and of
``ems_step.ems_observe`` (one launch: the longest query count of the row, then every slot's scores).

Like D2O's step (``triton_d2o_step``), the redundancy of the TBM token with every centre reads every raw key
and value of the row, so it is split over blocks of slots:
1. grid (rows,): the row's Global-Local score ratio and TBM token (scans of the positions and the three score
   states, 20 bytes a slot), once per row;
2. grid (rows, blocks): the best redundancy of the TBM token among each block's centres (ties: the oldest
   position);
3. grid (rows,): the best of the row's blocks, the merge decision, the weighted merge of two keys (unit raw
   directions rotated to the centre's position, ``rotate_like``'s rule) and two values, the merge state, one
   pass over the look-up table (members follow or leave, the new member takes a free or the oldest entry),
   and the move of the row's last slot into the TBM token's.
Three launches rather than two: with the TBM token found inside phase 2, each of its programs (hundreds per
row at batch 1) rescanned the row's four per-slot arrays to do ~C / blocks redundancies, ~100 us a layer on an
H100 at 6.5k slots against a launch's few microseconds.
Floating-point contraction is off; row sums, norms and cosines round differently from torch (float32 units in
the last place).
"""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvbench.kernels.redundancy import SIMILARITIES
from kvbench.kernels.triton_slots import (NO_POSITION, best_of_blocks, block_size, check_storage, fold_highest,
                                          fold_lowest, move_last, newest_position, row_blocks, scan_tile)

BLOCK_C = 8192  # slots per tile of a row scan
BLOCK_S = 32  # slots per tile of the redundancy scan
BLOCK_E = 4096  # look-up-table entries per tile
WARPS = 8
SCAN_WARPS = 16  # the TBM token's scans: one program per row, a whole tile of the row per load
EPS = tl.constexpr(1e-12)  # F.normalize's
REL_EPS = tl.constexpr(1e-4)  # rotate_like's


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
def _redundancy_kernel(raw_ptr, v_ptr, pos_ptr, len_ptr, t_ptr, outside_ptr, r_ptr, at_pos_ptr, at_slot_ptr, C, D,
                       DV, SPAN, NB, SIMILARITY: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_DV: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    t = tl.load(t_ptr + row)
    outside = tl.load(outside_ptr + row)
    length = tl.load(len_ptr + row)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    key_t = _unit(tl.load(raw_ptr + (row * C + t) * D + d, mask=d < D, other=0.0).to(tl.float32))
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
        if SIMILARITY != 2:  # the key factor (key_value, key)
            keys = tl.load(raw_ptr + (row * C + s[:, None]) * D + d[None, :], mask=centre[:, None] & (d[None, :] < D),
                           other=0.0).to(tl.float32)
            norm = tl.maximum(tl.sqrt_rn(tl.sum(keys * keys, 1)), EPS)
            R = tl.maximum(tl.sum(key_t[None, :] * tl.math.div_rn(keys, norm[:, None]), 1), 0.0)
        if SIMILARITY != 1:  # the value factor (key_value, value)
            values = tl.load(v_ptr + (row * C + s[:, None]) * DV + dv[None, :],
                             mask=centre[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
            norm = tl.maximum(tl.sqrt_rn(tl.sum(values * values, 1)), EPS)
            R = R * tl.maximum(tl.sum(value_t[None, :] * tl.math.div_rn(values, norm[:, None]), 1), 0.0)
        best, oldest, match = fold_highest(best, oldest, match, R, pos, s, centre)
    tl.store(r_ptr + row * NB + block, best)
    tl.store(at_pos_ptr + row * NB + block, oldest)
    tl.store(at_slot_ptr + row * NB + block, match)


@triton.jit
def _halves(ptr, HALF, BLOCK_H: tl.constexpr):
    """The two halves (i, i + D/2) of one vector, as float32."""
    h = tl.arange(0, BLOCK_H)
    return (tl.load(ptr + h, mask=h < HALF, other=0.0).to(tl.float32),
            tl.load(ptr + HALF + h, mask=h < HALF, other=0.0).to(tl.float32))


@triton.jit
def _rotate_like(x1, x2, raw_ptr, key_ptr, HALF, BLOCK_H: tl.constexpr):
    """redundancy.rotate_like: x rotated as RoPE took the raw key at ``raw_ptr`` to the key at ``key_ptr``."""
    r1, r2 = _halves(raw_ptr, HALF, BLOCK_H)
    p1, p2 = _halves(key_ptr, HALF, BLOCK_H)
    cos = p1 * r1 + p2 * r2
    sin = p2 * r1 - p1 * r2
    scale = tl.maximum(tl.sqrt_rn(cos * cos + sin * sin), 1e-30)
    usable = tl.sqrt_rn(r1 * r1 + r2 * r2) > REL_EPS * tl.sqrt_rn(tl.sum(r1 * r1, 0) + tl.sum(r2 * r2, 0))
    cos = tl.where(usable, tl.math.div_rn(cos, scale), 1.0)
    sin = tl.where(usable, tl.math.div_rn(sin, scale), 0.0)
    return x1 * cos - x2 * sin, x1 * sin + x2 * cos


@triton.jit
def _merge_kernel(k_ptr, raw_ptr, v_ptr, pos_ptr, len_ptr, state_ptr, keep_ptr, glo_ptr, past_ptr, cur_ptr,
                  mass_ptr, tokens_ptr, bias_ptr, lut_pos_ptr, lut_centre_ptr, lut_norm_ptr, t_ptr, ratio_ptr, r_ptr,
                  at_pos_ptr, at_slot_ptr, H, C, D, DV, S, state_stride, E, NB, TAU, GAMMA_BITS,
                  TBM_ALWAYS: tl.constexpr, LUT: tl.constexpr, TABLE: tl.constexpr, WITH_POSITIONS: tl.constexpr,
                  BIAS: tl.constexpr,
                  BLOCK_NB: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_E: tl.constexpr,
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
    t1, t2 = _halves(raw_ptr + (row * C + t) * D, HALF, BLOCK_H)
    d1, d2 = _halves(raw_ptr + (row * C + d) * D, HALF, BLOCK_H)
    norm_raw_t = tl.maximum(tl.sqrt_rn(tl.sum(t1 * t1, 0) + tl.sum(t2 * t2, 0)), EPS)
    norm_raw_d = tl.maximum(tl.sqrt_rn(tl.sum(d1 * d1, 0) + tl.sum(d2 * d2, 0)), EPS)
    s1 = tl.math.div_rn(d1, norm_raw_d) * f_d + tl.math.div_rn(t1, norm_raw_t) * f_t
    s2 = tl.math.div_rn(d2, norm_raw_d) * f_d + tl.math.div_rn(t2, norm_raw_t) * f_t
    norm_s = tl.maximum(tl.sqrt_rn(tl.sum(s1 * s1, 0) + tl.sum(s2 * s2, 0)), EPS)
    s1 = tl.math.div_rn(s1, norm_s)
    s2 = tl.math.div_rn(s2, norm_s)
    k1, k2 = _halves(k_ptr + (row * C + t) * D, HALF, BLOCK_H)
    norm_t = tl.sqrt_rn(tl.sum(k1 * k1, 0) + tl.sum(k2 * k2, 0))
    k1, k2 = _halves(k_ptr + (row * C + d) * D, HALF, BLOCK_H)
    norm_d = tl.sqrt_rn(tl.sum(k1 * k1, 0) + tl.sum(k2 * k2, 0))
    o1, o2 = _rotate_like(s1, s2, raw_ptr + (row * C + d) * D, k_ptr + (row * C + d) * D, HALF, BLOCK_H)
    if LUT:
        o1, o2 = o1 * norm_d, o2 * norm_d
    elif WITH_POSITIONS:  # each member expanded at its own position
        m1, m2 = _rotate_like(s1, s2, raw_ptr + (row * C + t) * D, k_ptr + (row * C + t) * D, HALF, BLOCK_H)
        o1, o2 = o1 * norm_d * f_d + m1 * norm_t * f_t, o2 * norm_d * f_d + m2 * norm_t * f_t
    else:
        norm = norm_d * f_d + norm_t * f_t
        o1, o2 = o1 * norm, o2 * norm
    h = tl.arange(0, BLOCK_H)
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
        _update_lut(lut_pos_ptr, lut_centre_ptr, lut_norm_ptr, row, E, tl.load(pos_ptr + row * C + t),
                    tl.load(pos_ptr + row * C + d), norm_t, merged, BLOCK_E)
    tl.debug_barrier()  # the merge is written before the move reads the last slot (it may be d)
    move_last(t, row, len_ptr, k_ptr, v_ptr, pos_ptr, state_ptr, C, D, DV, S, state_stride, BLOCK_D, BLOCK_DV,
              BLOCK_S)


@triton.jit
def _update_lut(pos_ptr, centre_ptr, norm_ptr, row, E, p_t, p_d, norm_t, merged, BLOCK_E: tl.constexpr):
    """ems_step._update_lut in one pass over the row's E entries, then one write."""
    first_free = tl.full((), 2147483647, tl.int64)
    oldest = tl.full((), NO_POSITION, tl.int64)
    oldest_entry = tl.full((), 0, tl.int64)
    for e0 in range(0, E, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        inside = e < E
        position = tl.load(pos_ptr + row * E + e, mask=inside, other=NO_POSITION)
        of_t = inside & (tl.load(centre_ptr + row * E + e, mask=inside, other=-1) == p_t)
        tl.store(centre_ptr + row * E + e, tl.where(merged, p_d, -1) + tl.zeros_like(e).to(tl.int64), mask=of_t)
        freed = of_t & (e < tl.where(merged, -1, E))  # zero class: t's members leave with it
        tl.store(pos_ptr + row * E + e, tl.full((BLOCK_E,), -1, tl.int64), mask=freed)
        tl.store(norm_ptr + row * E + e, tl.full((BLOCK_E,), -1.0, tl.float32), mask=freed)
        position = tl.where(freed, -1, position)
        first_free = tl.minimum(first_free, tl.min(tl.where(inside & (position < 0), e, 2147483647), 0).to(tl.int64))
        live = inside & (position >= 0)
        low = tl.min(tl.where(live, position, NO_POSITION), 0)
        at = tl.min(tl.where(live & (position == low), e, 2147483647), 0).to(tl.int64)
        oldest_entry = tl.where(low < oldest, at, oldest_entry)
        oldest = tl.minimum(low, oldest)
    has_free = first_free < E
    entry = tl.where(has_free, first_free, oldest_entry)
    insert = merged & (has_free | (p_t > oldest))
    tl.store(pos_ptr + row * E + entry, p_t, mask=insert)
    tl.store(centre_ptr + row * E + entry, p_d, mask=insert)
    tl.store(norm_ptr + row * E + entry, norm_t, mask=insert)


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


def ems_step(keys: Tensor, values: Tensor, positions: Tensor, lengths: Tensor, state: Tensor, raw_keys: Tensor,
             scores: tuple[Tensor, Tensor, Tensor], merges: tuple[Tensor, Tensor, Tensor | None],
             lut: tuple[Tensor, Tensor, Tensor] | None, n_keep: Tensor, window: int, tau: float, gamma: float,
             similarity: str, with_positions: bool) -> None:
    B, H, C, D = keys.shape
    merged_mass, merged_tokens, logit_bias = merges
    tables = lut if lut is not None else (positions, positions, merged_mass)  # unused stand-ins
    check_storage(lengths, keys, values, positions, state, raw_keys, *scores, merged_mass, merged_tokens, *tables)
    S, DV, rows, E = state.shape[0], values.shape[-1], B * H, tables[0].shape[-1] if lut is not None else 0
    NB, span = row_blocks(rows, C, BLOCK_S, keys.device)
    n_keep = n_keep.to(lengths).contiguous()
    t, outside = (torch.empty(rows, dtype=torch.long, device=keys.device) for _ in range(2))
    ratio = torch.empty(rows, dtype=torch.float32, device=keys.device)
    R = torch.empty(rows, NB, dtype=torch.float32, device=keys.device)
    at_position, at_slot = (torch.empty(rows, NB, dtype=torch.long, device=keys.device) for _ in range(2))
    _tbm_kernel[(rows,)](positions, lengths, n_keep, *scores, t, ratio, outside, H, C, window,
                         BLOCK_C=scan_tile(C, BLOCK_C), num_warps=SCAN_WARPS)
    _redundancy_kernel[(rows, NB)](raw_keys, values, positions, lengths, t, outside, R, at_position, at_slot, C, D,
                                   DV, span, NB, SIMILARITY=SIMILARITIES.index(similarity), BLOCK_S=BLOCK_S,
                                   BLOCK_D=block_size(D), BLOCK_DV=block_size(DV), num_warps=WARPS)
    gamma_bits = 0 if math.isinf(gamma) else struct.unpack("<q", struct.pack("<d", gamma - 1))[0]
    _merge_kernel[(rows,)](keys, raw_keys, values, positions, lengths, state, n_keep, *scores, merged_mass,
                           merged_tokens, merged_mass if logit_bias is None else logit_bias, *tables, t, ratio, R,
                           at_position, at_slot, H, C, D, DV, S, B * H * C, E, NB, tau, gamma_bits,
                           TBM_ALWAYS=math.isinf(gamma), LUT=lut is not None, TABLE=E > 0,
                           WITH_POSITIONS=with_positions, BIAS=logit_bias is not None, BLOCK_NB=block_size(NB),
                           BLOCK_H=block_size(D // 2), BLOCK_DV=block_size(DV),
                           BLOCK_E=scan_tile(E, BLOCK_E), BLOCK_D=block_size(D), BLOCK_S=block_size(S),
                           num_warps=WARPS, enable_fp_fusion=False)
