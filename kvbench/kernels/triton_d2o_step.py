"""Triton twin of ``d2o_step.d2o_step``: D2O's decode step in four launches.

The best match reads every key of the row (O(C d), the step's only large read), so it is split over blocks of
slots to run at memory bandwidth when the batch has few rows; the victim has to be known before any cosine,
and the threshold (under ``threshold_scope=layer``) needs every head's best match, hence the phases:
1. grid (rows, blocks): the newest position of each block of the row (``triton_slots.newest_by_blocks``; not with
   ``newest_last``, where the row's last real slot holds it), then
   each block's lowest attention outside the row's sinks and recent window (12 bytes a slot): the victim is
   their fold, which the next two phases make from the blocks' results (a handful of values); given a one-query
   pass's step attention still pending (``step``, a ``triton_decode.PendingStep``), this launch makes it and adds
   it to the accumulated attention first (``_step_victim_kernel``, on the step launch's blocks of slots): the
   step attention's own launch and the victim's are one;
2. grid (rows, blocks): the best cosine of the victim's key among each block's slots (ties: the oldest
   position); blocks of many tiles (a large batch) stream theirs (``_match_streamed_kernel``, the same bits);
3. grid (rows,): the best of the row's blocks, the EMA threshold, the weighted merge of two keys and two
   values, the threshold on every slot, and the move of the row's last slot into the victim's.
With the victim found inside phase 2, each of its programs (hundreds per row at batch 1, as many as the device
holds) rescanned the whole row to do ~C / blocks cosines, ~45 us a layer on an H100 at 6.5k slots against a
launch's few microseconds; one program per row finding it was latency-bound at a batch of one.
Floating-point contraction is off; cosines and exp round differently from torch's matmul and exp (float32
units in the last place: a cosine is the unit victim key's dot product with a key divided by that key's norm,
where torch divides every element of the key first), which moves a merge decision only when a cosine sits
within that of the threshold or of another slot's cosine.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvbench.kernels.triton_decode import INTERPRETED, STEP_BLOCK, PendingStep, group_mean_factor, step_mean
from kvbench.kernels.triton_slots import (BLOCK_SCAN, NO_POSITION, best_of_blocks, block_size, check_storage,
                                          droppable, fold_blocks, fold_highest, fold_lowest, last_position, lowest_in,
                                          move_last, newest_by_blocks, row_blocks, row_newest, scan_tile, store_block)

BLOCK_C = 8192  # slots per tile of the threshold's row-wide write
BLOCK_S = 64  # keys per tile of the cosine scan
WARPS = 8
MATCH_WARPS = 4  # the best-match launch's: with 8 programs a multiprocessor, 4 warps each beat 8 (call 49)
# _match_streamed_kernel's (keys a tile, warps); its sums have _match_kernel's layouts, hence its bits, where
# streamed_match lets it run (tests/kernels/ptx_check.py asserts it)
STREAMED_TILE = (32, MATCH_WARPS)
STREAMED_MIN_SPAN = 512  # slots a program walks (BLOCK_S keys a tile) from which the streamed kernel is used
EPS = tl.constexpr(1e-12)  # F.normalize's


@triton.jit
def _protection(keep_ptr, row, H, length, N_HEAVY, N_RECENT, N_SINKS):
    """(sinks, recent) of a row of ``length`` slots (``d2o_step.protection`` of its budget, clamped to the row)."""
    keep = tl.minimum(tl.load(keep_ptr + row // H), length)
    recent = keep * N_RECENT // (N_HEAVY + N_RECENT)
    return tl.minimum(keep - recent, N_SINKS), recent


@triton.jit
def _victim_kernel(att_ptr, pos_ptr, len_ptr, keep_ptr, newest_ptr, best_ptr, oldest_ptr, slot_ptr, H, C, span, NB,
                   N_HEAVY, N_RECENT, N_SINKS, NEWEST_LAST: tl.constexpr, BLOCK_C: tl.constexpr,
                   BLOCK_NB: tl.constexpr):
    """Program (row, block): the block's lowest attention outside the row's sinks and recent window
    (d2o_step.protection; the row's newest position is the blocks', or the last real slot's: ``row_newest``)."""
    row, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    length = tl.load(len_ptr + row)
    sinks, recent = _protection(keep_ptr, row, H, length, N_HEAVY, N_RECENT, N_SINKS)
    newest = row_newest(newest_ptr, pos_ptr, row, length, C, NB, NEWEST_LAST, BLOCK_NB)
    start = block * span
    best, oldest, slot = lowest_in(att_ptr + row * C, pos_ptr, row, length, sinks, recent, newest, 1, C, start,
                                   tl.minimum(start + span, C), True, BLOCK_C)
    store_block(best_ptr, oldest_ptr, slot_ptr, row * NB + block, best, oldest, slot)


@triton.jit
def _step_victim_kernel(logit_ptr, lse_ptr, att_ptr, pos_ptr, len_ptr, keep_ptr, best_ptr, oldest_ptr, slot_ptr, H,
                        C, span, factor, NB, N_HEAVY, N_RECENT, N_SINKS, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                        EXACT_EXP: tl.constexpr):
    """Program (block of BLOCK slots, row): the pass's step attention added to the row's accumulated attention
    (``triton_decode._step_attention``'s launch, the same bits), then, from those sums in registers, the block's
    lowest outside the sinks and the recent window (``_victim_kernel``'s; the newest position is the row's last
    slot's, as after a one-query pass)."""
    block, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    c = block * BLOCK + tl.arange(0, BLOCK)
    score = step_mean(logit_ptr, lse_ptr, row, c, C, span, factor, GROUP, BLOCK, EXACT_EXP)
    score += tl.load(att_ptr + row * C + c, mask=c < C, other=0.0)
    tl.store(att_ptr + row * C + c, score, mask=c < C)
    length = tl.load(len_ptr + row)
    sinks, recent = _protection(keep_ptr, row, H, length, N_HEAVY, N_RECENT, N_SINKS)
    newest = last_position(pos_ptr, row, length, C)
    real = c < length
    pos = tl.load(pos_ptr + row * C + c, mask=real, other=-1)
    best, oldest, slot = fold_lowest(tl.full((), float("inf"), tl.float32), tl.full((), NO_POSITION, tl.int64),
                                     tl.full((), 0, tl.int64), score, pos, c,
                                     droppable(c, pos, real, sinks, recent, newest))
    store_block(best_ptr, oldest_ptr, slot_ptr, row * NB + block, best, oldest, slot)


@triton.jit
def _match_kernel(k_ptr, pos_ptr, len_ptr, low_ptr, low_pos_ptr, low_slot_ptr, sim_ptr, at_pos_ptr, at_slot_ptr, C, D,
                  SPAN, NB, VNB, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_VNB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    victim = fold_blocks(low_ptr, low_pos_ptr, low_slot_ptr, row, VNB, BLOCK_VNB)
    length = tl.load(len_ptr + row)
    d = tl.arange(0, BLOCK_D)
    source = tl.load(k_ptr + (row * C + victim) * D + d, mask=d < D, other=0.0).to(tl.float32)
    source = tl.math.div_rn(source, tl.maximum(tl.sqrt_rn(tl.sum(source * source, 0)), EPS))
    best = tl.full((), float("-inf"), tl.float32)
    oldest = tl.full((), NO_POSITION, tl.int64)
    match = tl.full((), -1, tl.int64)
    for s0 in range(block * SPAN, block * SPAN + SPAN, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        real = s < length  # not masked by the victim: the tile's loads need not wait for it
        key = tl.load(k_ptr + (row * C + s[:, None]) * D + d[None, :], mask=real[:, None] & (d[None, :] < D),
                      other=0.0).to(tl.float32)
        norm = tl.maximum(tl.sqrt_rn(tl.sum(key * key, 1)), EPS)
        other = real & (s != victim)
        # the dot product divided by the key's norm, not the key's every element divided (torch's unit keys):
        # 0.6x the launch (call 49), cosines within a float32 ulp or two of the per-element form
        cosine = tl.where(other, tl.math.div_rn(tl.sum(source[None, :] * key, 1), norm), float("-inf"))
        pos = tl.load(pos_ptr + row * C + s, mask=other, other=NO_POSITION)
        best, oldest, match = fold_highest(best, oldest, match, cosine, pos, s, other)
    store_block(sim_ptr, at_pos_ptr, at_slot_ptr, row * NB + block, best, oldest, match)


@triton.jit
def _match_streamed_kernel(k_ptr, pos_ptr, len_ptr, low_ptr, low_pos_ptr, low_slot_ptr, sim_ptr, at_pos_ptr,
                           at_slot_ptr, C, D, SPAN, NB, VNB, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_VNB: tl.constexpr):
    """``_match_kernel``'s result, bit for bit, for programs that walk many tiles (a large batch): the next tile's
    keys load while this one's cosines are made (the first tile's while the victim is folded), and each lane keeps
    its own best (score, oldest position, slot; the fold's total order) so that the loop has no cross-warp
    reduction; one ``fold_highest`` at the end. 104 rows x 8 heads x 3,277 slots: 281 -> 220 us on an H200; at
    batch one (two tiles a program) 14.6 -> 15.0 us, hence ``STREAMED_MIN_SPAN`` (s13 call 3)."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    length = tl.load(len_ptr + row)
    end = tl.minimum(block * SPAN + SPAN, length)
    d = tl.arange(0, BLOCK_D)
    s = block * SPAN + tl.arange(0, BLOCK_S)
    key = tl.load(k_ptr + (row * C + s[:, None]) * D + d[None, :], mask=(s < end)[:, None] & (d[None, :] < D),
                  other=0.0)
    pos = tl.load(pos_ptr + row * C + s, mask=s < end, other=NO_POSITION)
    victim = fold_blocks(low_ptr, low_pos_ptr, low_slot_ptr, row, VNB, BLOCK_VNB)
    source = tl.load(k_ptr + (row * C + victim) * D + d, mask=d < D, other=0.0).to(tl.float32)
    source = tl.math.div_rn(source, tl.maximum(tl.sqrt_rn(tl.sum(source * source, 0)), EPS))
    best = tl.full((BLOCK_S,), float("-inf"), tl.float32)
    oldest = tl.full((BLOCK_S,), NO_POSITION, tl.int64)
    match = tl.full((BLOCK_S,), -1, tl.int64)
    for s0 in range(block * SPAN, block * SPAN + SPAN, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        after = s + BLOCK_S
        next_key = tl.load(k_ptr + (row * C + after[:, None]) * D + d[None, :],
                           mask=(after < end)[:, None] & (d[None, :] < D), other=0.0)
        next_pos = tl.load(pos_ptr + row * C + after, mask=after < end, other=NO_POSITION)
        tile = key.to(tl.float32)
        norm = tl.maximum(tl.sqrt_rn(tl.sum(tile * tile, 1)), EPS)
        other = (s < end) & (s != victim)
        cosine = tl.math.div_rn(tl.sum(source[None, :] * tile, 1), norm)  # as _match_kernel's
        # a lane meets its slots in rising order: an equal (cosine, position) keeps the lower slot, as the fold does
        better = other & ((cosine > best) | ((cosine == best) & (pos < oldest)))
        best, oldest, match = (tl.where(better, cosine, best), tl.where(better, pos, oldest),
                               tl.where(better, s, match))
        key, pos = next_key, next_pos
    best, oldest, match = fold_highest(tl.full((), float("-inf"), tl.float32), tl.full((), NO_POSITION, tl.int64),
                                       tl.full((), -1, tl.int64), best, oldest, match, match >= 0)
    store_block(sim_ptr, at_pos_ptr, at_slot_ptr, row * NB + block, best, oldest, match)


@triton.jit
def _merge_kernel(k_ptr, v_ptr, pos_ptr, len_ptr, state_ptr, thr_ptr, low_ptr, low_pos_ptr, low_slot_ptr, sim_ptr,
                  at_pos_ptr, at_slot_ptr, H, C, D, DV, S, state_stride, NB, VNB, BETA, ONE_MINUS_BETA, OWN,
                  LAYER_SCOPE: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_C: tl.constexpr,
                  BLOCK_NB: tl.constexpr, BLOCK_VNB: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    victim = fold_blocks(low_ptr, low_pos_ptr, low_slot_ptr, row, VNB, BLOCK_VNB)
    similarity, match = best_of_blocks(sim_ptr, at_pos_ptr, at_slot_ptr, row, NB, BLOCK_NB)
    if LAYER_SCOPE:  # d2o_step.ema_threshold: the mean best cosine over the batch row's heads
        total = tl.full((), 0.0, tl.float32)
        for head in range(H):
            head_best, _ = best_of_blocks(sim_ptr, at_pos_ptr, at_slot_ptr, row - row % H + head, NB, BLOCK_NB)
            total += head_best
        current = tl.math.div_rn(total, H + tl.zeros((), tl.float32))
    else:
        current = similarity
    previous = tl.load(thr_ptr + row * C)
    tau = tl.where(previous != previous, current, BETA * current + ONE_MINUS_BETA * previous)
    merged = (match >= 0) & (similarity >= tau)
    if WEIGHTED:  # d2o_step.merge_terms
        raw = tl.exp(similarity)
        mass = raw
    else:
        raw = similarity
        mass = 1.0
    norm = tl.maximum(OWN + tl.where(merged, mass, 0.0), 1e-12)
    own = tl.math.div_rn(OWN + tl.zeros((), tl.float32), norm)
    incoming = tl.math.div_rn(tl.where(merged, raw, 0.0), norm)
    target = tl.maximum(match, 0)
    d = tl.arange(0, BLOCK_D)
    k_t = tl.load(k_ptr + (row * C + target) * D + d, mask=d < D).to(tl.float32)
    k_v = tl.load(k_ptr + (row * C + victim) * D + d, mask=d < D).to(tl.float32)
    tl.store(k_ptr + (row * C + target) * D + d, (own * k_t + incoming * k_v).to(k_ptr.dtype.element_ty),
             mask=d < tl.where(merged, D, 0))
    dv = tl.arange(0, BLOCK_DV)
    v_t = tl.load(v_ptr + (row * C + target) * DV + dv, mask=dv < DV).to(tl.float32)
    v_v = tl.load(v_ptr + (row * C + victim) * DV + dv, mask=dv < DV).to(tl.float32)
    tl.store(v_ptr + (row * C + target) * DV + dv, (own * v_t + incoming * v_v).to(v_ptr.dtype.element_ty),
             mask=dv < tl.where(merged, DV, 0))
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        tl.store(thr_ptr + row * C + c, tau + tl.zeros((BLOCK_C,), tl.float32), mask=c < C)
    tl.debug_barrier()  # the merge and the threshold are written before the move reads the last slot
    move_last(victim, row, len_ptr, k_ptr, v_ptr, pos_ptr, state_ptr, C, D, DV, S, state_stride, BLOCK_D,
              BLOCK_DV, BLOCK_S)


def streamed_match(span: int, head_dim: int, itemsize: int) -> bool:
    """Whether the best match runs streamed: a program walks many tiles, and each thread's share of a streamed tile
    holds a whole 16-byte vector of a key row. The compiler loads a tile in the widest vectors that share allows and
    sums each key row in-thread along its vector, then across lanes; with a smaller share the streamed tile's row
    sums split otherwise than the tiled kernel's, so their cosines' last bits differ (head dim 16 in bf16 on the
    H200: one ulp, s14)."""
    rows, warps = STREAMED_TILE
    return span >= STREAMED_MIN_SPAN and rows * head_dim * itemsize >= 16 * 32 * warps


def d2o_step(keys: Tensor, values: Tensor, positions: Tensor, lengths: Tensor, state: Tensor, attention: Tensor,
             threshold: Tensor, n_keep: Tensor, n_heavy: int, n_recent: int, n_sinks: int, beta: float,
             layer_scope: bool, weighted: bool, newest_last: bool = False,
             step: Callable[..., Tensor] | None = None) -> None:
    B, H, C, D = keys.shape
    check_storage(lengths, keys, values, positions, state, attention, threshold)
    S, DV, rows = state.shape[0], values.shape[-1], B * H
    NB, span = row_blocks(rows, C, BLOCK_S, keys.device)
    n_keep = n_keep.to(lengths).contiguous()
    fused = isinstance(step, PendingStep) and newest_last and step.logits.shape == (B, H * step.group, C)
    if step is not None and not fused:
        step(into=attention)
    # the victim's blocks: the step attention's with the step fused in
    VNB, victim_span = (triton.cdiv(C, STEP_BLOCK), STEP_BLOCK) if fused else row_blocks(rows, C, BLOCK_SCAN,
                                                                                          keys.device)
    low_position, low_slot = (torch.empty(rows * VNB, dtype=torch.long, device=keys.device) for _ in range(2))
    low = torch.empty(rows * VNB, dtype=torch.float32, device=keys.device)
    similarity = torch.empty(rows, NB, dtype=torch.float32, device=keys.device)
    at_position, at_slot = (torch.empty(rows, NB, dtype=torch.long, device=keys.device) for _ in range(2))
    if fused:
        _step_victim_kernel[(VNB, rows)](step.logits, step.lse.contiguous(), attention, positions, lengths, n_keep,
                                         low, low_position, low_slot, H, C, step.span, group_mean_factor(step.group),
                                         VNB, n_heavy, n_recent, n_sinks, GROUP=step.group, BLOCK=STEP_BLOCK,
                                         EXACT_EXP=not INTERPRETED, enable_fp_fusion=False)
    else:
        newest = newest_by_blocks(positions, lengths, VNB, victim_span, wanted=not newest_last)
        _victim_kernel[(rows, VNB)](attention, positions, lengths, n_keep, newest, low, low_position, low_slot, H,
                                    C, victim_span, VNB, n_heavy, n_recent, n_sinks, NEWEST_LAST=newest_last,
                                    BLOCK_C=BLOCK_SCAN, BLOCK_NB=block_size(VNB))
    if streamed_match(span, D, keys.element_size()):
        match_kernel, (block_s, warps) = _match_streamed_kernel, STREAMED_TILE
    else:
        match_kernel, block_s, warps = _match_kernel, BLOCK_S, MATCH_WARPS
    match_kernel[(rows, NB)](keys, positions, lengths, low, low_position, low_slot, similarity, at_position, at_slot,
                             C, D, span, NB, VNB, BLOCK_S=block_s, BLOCK_D=block_size(D),
                             BLOCK_VNB=block_size(VNB), num_warps=warps)
    _merge_kernel[(rows,)](keys, values, positions, lengths, state, threshold, low, low_position, low_slot,
                           similarity, at_position, at_slot, H, C, D, DV, S, B * H * C, NB, VNB, beta, 1 - beta,
                           math.e if weighted else 1.0, LAYER_SCOPE=layer_scope, WEIGHTED=weighted,
                           BLOCK_C=scan_tile(C, BLOCK_C), BLOCK_NB=block_size(NB), BLOCK_VNB=block_size(VNB),
                           BLOCK_D=block_size(D), BLOCK_DV=block_size(DV), BLOCK_S=block_size(S), num_warps=WARPS,
                           enable_fp_fusion=False)
