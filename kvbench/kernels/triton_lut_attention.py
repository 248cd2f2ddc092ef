"""Triton twin of ``lut_attention.lut_attention``: EMS's one-query attention over stored slots and LUT members
in five launches, reading K once, V once and the table once, every launch split over slots or table entries
(a program per (split, b, kv head), every query head of the GQA group a row of its tiles, as ``triton_decode``):

1. ``_slot_logits``, over key splits: the stored logits l_c (B, H_q, T) float32 (-inf past the row's length),
   the stored keys' norms (B, H, T), each split's largest logit, and zeros in launch 3's buffer
   (``lut_attention_at_centres``: also every real slot at its position in ``centre_slots``' position map);
2. ``_member_logits``, over table splits: the members' logits rho_j l_c, gathered from launch 1's buffers
   (-inf where not live), and each split's largest (``lut_attention_at_centres``: each member's centre slot and
   liveness read through the map first, the slot kept for launch 3);
3. ``_member_weights``, over table splits: M, the largest logit of the row (from both launches' maxima), and
   each member's weight exp(rho_j l_c - M) added onto its centre's slot (float32 atomic adds into the
   (B, H_q, T) buffer launch 1 zeroed, in any order, as ``fold_entries`` does);
4. ``_weighted_values``, over key splits: W_c = exp(l_c - M) + the members' weights, the split's sum_c W_c v_c
   and sum_c W_c (and W itself for the step attention, in launch 1's buffer);
5. ``_combine``, twice: one program per row adds the splits' sums (all splits in one tile) and stores the output divided
   by the row's sum_c W_c in the query's dtype; then, over blocks of slots, the same sums give the step attention
   W / sum averaged over the group (no atomics in the output: deterministic given the member weights). The
   second launch can wait for the caller (``defer_step``): a decode step waits only for the output.
A member pass of one program per row would loop over the whole table with dependent gathers (latency-bound
at tens of thousands of entries); split, every launch is a few iterations per program. The grids depend on the
storage's capacity and the table's size only: a captured CUDA graph replays while rows grow and shrink. Under
the CPU interpreter, inputs are cast to float32 after loading (``triton_decode``). Launch 5 replaced seven torch
operations (two sums over the splits, a clamp, two divisions, a cast and the group's mean) and launch 1's zeros a
memset, all on a decode step's critical path (EMS reads this at every layer); the sums over splits and heads run
in another order than torch's, so the output and the step attention may differ from theirs in the last float32
bit (the member weights' atomic adds already make them differ from run to run).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvbench.kernels.attention_stats import pending_step
from kvbench.kernels.lut_attention import NORM_EPS
from kvbench.kernels.triton_decode import INTERPRETED, split_plan
from kvbench.kernels.triton_lut_expand import map_positions, mapped_centres

# (slots a tile, warps, stages) of launches 1 and 4: on an H200 at 32 rows x 8 heads x 3,277 slots, launch 4 took
# 94 us with 128-slot tiles against 185 with ``triton_decode.DECODE_TILES``' 64 (launch 1: 110 against 108)
LUT_TILES = (128, 4, 3)
MEMBER_BLOCK = 1024  # table entries per program of launches 2 and 3
COMBINE_BLOCK = 1024  # slots per program of launch 5


@triton.jit
def _row_max(slot_max_ptr, member_max_ptr, q_rows, head_ok, n_splits, n_member_splits,
             BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_SE: tl.constexpr):
    """(BLOCK_M,) the largest logit of each query row over its key splits' and table splits' maxima (0 where
    there is none: an empty row weighs nothing)."""
    s, se = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_SE)
    slot_max = tl.load(slot_max_ptr + q_rows[:, None] * n_splits + s[None, :],
                       mask=head_ok[:, None] & (s[None, :] < n_splits), other=float("-inf"))
    member_max = tl.load(member_max_ptr + q_rows[:, None] * n_member_splits + se[None, :],
                         mask=head_ok[:, None] & (se[None, :] < n_member_splits), other=float("-inf"))
    top = tl.maximum(tl.max(slot_max, 1), tl.max(member_max, 1))
    return tl.where(top == float("-inf"), 0.0, top)


@triton.jit
def _slot_logits(
    q_ptr, k_ptr, len_ptr, logit_ptr, norm_ptr, max_ptr, mweight_ptr, pos_ptr, map_ptr,
    sqb, sqh, sqd, skb, skh, skt, skd, spb, sph, spt,
    H, T, D, split_size, n_splits, scaling, LIMIT,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, LOOKUP: tl.constexpr,
):
    split, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = row // H, row % H
    heads = tl.arange(0, BLOCK_M)
    head_ok = heads < GROUP
    hq = h * GROUP + heads
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + b * sqb + hq[:, None] * sqh + d[None, :] * sqd, mask=head_ok[:, None] & (d[None, :] < D),
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    length = tl.load(len_ptr + row)
    start = split * split_size
    top = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    for n0 in range(start, tl.minimum(start + split_size, T), BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        inside = cols < T
        real = cols < length
        k = tl.load(k_ptr + b * skb + h * skh + cols[:, None] * skt + d[None, :] * skd,
                    mask=real[:, None] if EVEN_D else real[:, None] & (d[None, :] < D), other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling
        s = tl.where(real[None, :], s, float("-inf"))
        tl.store(logit_ptr + (b * H * GROUP + hq[:, None]) * T + cols[None, :], s,
                 mask=head_ok[:, None] & inside[None, :])
        tl.store(mweight_ptr + (b * H * GROUP + hq[:, None]) * T + cols[None, :],
                 tl.zeros((BLOCK_M, BLOCK_N), tl.float32), mask=head_ok[:, None] & inside[None, :])
        top = tl.maximum(top, tl.max(s, 1))
        kf = k.to(tl.float32)
        tl.store(norm_ptr + row * T + cols, tl.sqrt(tl.sum(kf * kf, axis=1)), mask=inside)
        if LOOKUP:  # the position map launch 2 finds the members' centres in
            map_positions(map_ptr, row, cols, real & inside,
                          tl.load(pos_ptr + b * spb + h * sph + cols * spt, mask=real & inside, other=0), LIMIT)
    tl.store(max_ptr + (row * GROUP + heads) * n_splits + split, top, mask=head_ok)


@triton.jit
def _member_logits(
    logit_ptr, norm_ptr, slot_ptr, mnorm_ptr, live_ptr, mlogit_ptr, mmax_ptr, map_ptr, pos_ptr, centre_ptr, len_ptr,
    spb, sph, spt, scb, sch, sce, H, T, E, n_member_splits, norm_eps, LIMIT,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, LOOKUP: tl.constexpr,
):
    split, row = tl.program_id(0), tl.program_id(1).to(tl.int64)  # row: (b, kv head)
    heads = tl.arange(0, BLOCK_M)
    head_ok = heads < GROUP
    q_rows = row * GROUP + heads  # (b, query head): H_q = GROUP * H, query head // GROUP = kv head
    j = split * BLOCK_E + tl.arange(0, BLOCK_E)
    if LOOKUP:  # each member's centre slot through launch 1's map, kept for launch 3
        slot, live = mapped_centres(map_ptr, pos_ptr, centre_ptr, row, row // H, row % H, j, j < E,
                                    tl.load(len_ptr + row), T, LIMIT, spb, sph, spt, scb, sch, sce)
        tl.store(slot_ptr + row * E + j, slot, mask=j < E)
    else:
        live = tl.load(live_ptr + row * E + j, mask=j < E, other=0) != 0
        slot = tl.load(slot_ptr + row * E + j, mask=live, other=0)
    rho = tl.load(mnorm_ptr + row * E + j, mask=live, other=0.0) / \
        tl.maximum(tl.load(norm_ptr + row * T + slot, mask=live, other=1.0), norm_eps)
    both = head_ok[:, None] & live[None, :]
    at_centre = tl.load(logit_ptr + q_rows[:, None] * T + slot[None, :], mask=both, other=0.0)
    member = tl.where(both, rho[None, :] * at_centre, float("-inf"))
    tl.store(mlogit_ptr + q_rows[:, None] * E + j[None, :], member, mask=head_ok[:, None] & (j[None, :] < E))
    tl.store(mmax_ptr + q_rows * n_member_splits + split, tl.max(member, 1), mask=head_ok)


@triton.jit
def _member_weights(
    slot_ptr, mlogit_ptr, smax_ptr, mmax_ptr, top_ptr, mweight_ptr,
    T, E, n_splits, n_member_splits,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_SE: tl.constexpr,
):
    split, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    heads = tl.arange(0, BLOCK_M)
    head_ok = heads < GROUP
    q_rows = row * GROUP + heads
    top = _row_max(smax_ptr, mmax_ptr, q_rows, head_ok, n_splits, n_member_splits, BLOCK_M, BLOCK_S, BLOCK_SE)
    if split == 0:  # the row's M for launch 4
        tl.store(top_ptr + q_rows, top, mask=head_ok)
    j = split * BLOCK_E + tl.arange(0, BLOCK_E)
    inside = head_ok[:, None] & (j[None, :] < E)
    member = tl.load(mlogit_ptr + q_rows[:, None] * E + j[None, :], mask=inside, other=float("-inf"))
    live = member > float("-inf")
    slot = tl.load(slot_ptr + row * E + j, mask=j < E, other=0)
    # relaxed: nothing reads the sums before the launch ends. The default (acq_rel) compiles to a returning atom.acq_rel
    # an element, the relaxed add to a fire-and-forget red: 24.2 -> 10.2 us at 1 row x 8 heads x 6,555 slots and
    # 237 -> 106 us at 32 x 8 x 3,277 on an H200 (scripts/bench_ems_kernels.py)
    tl.atomic_add(mweight_ptr + q_rows[:, None] * T + slot[None, :], tl.exp(member - top[:, None]), mask=live,
                  sem="relaxed")


@triton.jit
def _weighted_values(
    v_ptr, logit_ptr, mweight_ptr, top_ptr, acc_ptr, sum_ptr,
    svb, svh, svt, svd,
    H, T, DV, split_size, n_splits,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_D: tl.constexpr, WANT_STEP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    split, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = row // H, row % H
    heads = tl.arange(0, BLOCK_M)
    head_ok = heads < GROUP
    q_rows = row * GROUP + heads  # (b, query head) rows of the buffers
    top = tl.load(top_ptr + q_rows, mask=head_ok, other=0.0)
    dv = tl.arange(0, BLOCK_DV)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    start = split * split_size
    for n0 in range(start, tl.minimum(start + split_size, T), BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        inside = cols < T
        at = q_rows[:, None] * T + cols[None, :]
        tile = head_ok[:, None] & inside[None, :]
        logit = tl.load(logit_ptr + at, mask=tile, other=float("-inf"))
        weight = tl.exp(logit - top[:, None]) + tl.load(mweight_ptr + at, mask=tile, other=0.0)
        total += tl.sum(weight, 1)
        v = tl.load(v_ptr + b * svb + h * svh + cols[:, None] * svt + dv[None, :] * svd,
                    mask=inside[:, None] if EVEN_D else inside[:, None] & (dv[None, :] < DV), other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc += tl.dot(weight.to(v.dtype), v, input_precision=PRECISION)
        if WANT_STEP:  # W over launch 1's logits (this program read them last)
            tl.store(logit_ptr + at, weight, mask=tile)
    # partials laid out (b, split, query head): torch sums them over the splits
    part = ((b * n_splits + split) * H + h) * GROUP + heads
    tl.store(acc_ptr + part[:, None] * BLOCK_DV + dv[None, :], acc, mask=head_ok[:, None])
    tl.store(sum_ptr + part, total, mask=head_ok)


@triton.jit
def _combine(
    acc_ptr, sum_ptr, weight_ptr, out_ptr, step_ptr, H, T, DV, n_splits, factor,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr, WANT_OUT: tl.constexpr, WANT_STEP: tl.constexpr,
):
    block, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = row // H, row % H
    heads, splits = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_S)
    split_ok = splits < n_splits
    # every split of every query head of the group in one tile (n_splits <= BLOCK_S): a loop over the splits
    # waited on one load at a time (9 us of the 48 at 1 x 8 x 6,555 slots on an H200)
    parts = ((b * n_splits + splits[:, None]) * H + h) * GROUP + heads[None, :]
    sums = tl.load(sum_ptr + parts, mask=split_ok[:, None] & (heads < GROUP)[None, :], other=0.0)
    total = tl.maximum(tl.sum(sums, 0), 1e-30)  # (BLOCK_M,) each query head's sum_c W_c; >= 1 with a real slot
    if WANT_OUT:  # the output of the group's query heads, in the first block
        if block == 0:
            dv = tl.arange(0, BLOCK_DV)
            for g in tl.static_range(GROUP):
                head_parts = ((b * n_splits + splits) * H + h) * GROUP + g
                acc = tl.load(acc_ptr + head_parts[:, None] * BLOCK_DV + dv[None, :], mask=split_ok[:, None],
                              other=0.0)
                head_total = tl.sum(tl.where(heads == g, total, 0.0))  # head g's entry, exactly
                tl.store(out_ptr + (row * GROUP + g) * DV + dv, (tl.sum(acc, 0) / head_total).to(
                    out_ptr.dtype.element_ty), mask=dv < DV)
    if WANT_STEP:  # W / sum_c W_c of every query head, averaged over the group
        cols = block * BLOCK_T + tl.arange(0, BLOCK_T)
        step = tl.zeros((BLOCK_T,), tl.float32)
        for g in tl.static_range(GROUP):
            head_total = tl.sum(tl.where(heads == g, total, 0.0))
            step += tl.load(weight_ptr + (row * GROUP + g) * T + cols, mask=cols < T, other=0.0) / head_total
        tl.store(step_ptr + row * T + cols, step * factor, mask=cols < T)


def lut_attention(query: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, member_slot: Tensor,
                  member_norm: Tensor, live: Tensor, scaling: float, want_step: bool = False, defer_step: bool = False,
                  ) -> tuple[Tensor, Tensor | Callable[..., Tensor] | None]:
    """Triton ``lut_attention.lut_attention``; deferred, the step attention's launch is the callable's."""
    return _attend(query, keys, values, lengths, member_slot.contiguous(), member_norm, scaling, want_step, defer_step,
                   live=live.contiguous().view(torch.int8))  # bool read as bytes: a view, no copy


def lut_attention_at_centres(query: Tensor, keys: Tensor, values: Tensor, positions: Tensor, lengths: Tensor,
                             centre: Tensor, member_norm: Tensor, position_limit: int, scaling: float,
                             want_step: bool = False, defer_step: bool = False,
                             ) -> tuple[Tensor, Tensor | Callable[..., Tensor] | None]:
    """Triton ``lut_attention.lut_attention_at_centres``: ``centre_slots``' position map (``triton_lut_expand``)
    in launches 1 and 2, not two launches of its own before them. Launch 1 writes every real slot at its position
    in a (B, H, position_limit) int32 map (``torch.empty``: a stale entry fails the check, as there), launch 2 reads
    every member's centre there, checks it and keeps the slot for launch 3; launches 2-5 then compute what they
    compute from ``centre_slots``' slots. On an H200, the call as a decode step makes it (graph replay, one process):
    51.9 -> 46.9 us at 1 x 8 x 6,555 slots, 82.3 -> 79.2 at 1 x 8 x 13,108; EMS's 32k TPOT / full 1.12 -> 1.09
    (``results/gpu/2026-11-30/logs/s20_call6_*``)."""
    B, H = positions.shape[:2]
    lookup = (positions, centre, torch.empty(B, H, position_limit, dtype=torch.int32, device=positions.device))
    return _attend(query, keys, values, lengths, torch.empty(B, H, centre.shape[-1], dtype=torch.long,
                                                             device=positions.device),
                   member_norm, scaling, want_step, defer_step, lookup=lookup)


def _attend(query: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, member_slot: Tensor, member_norm: Tensor,
            scaling: float, want_step: bool, defer_step: bool, live: Tensor | None = None,
            lookup: tuple[Tensor, Tensor, Tensor] | None = None,
            ) -> tuple[Tensor, Tensor | Callable[..., Tensor] | None]:
    """The five launches, the members given by ``member_slot`` and ``live`` (int8), or by ``lookup`` = (positions,
    centre, position map), launch 2 then writing the slots it finds into ``member_slot``."""
    B, Hq, _, D = query.shape
    H, T, DV, E = keys.shape[1], keys.shape[2], values.shape[-1], member_slot.shape[-1]
    group = Hq // H
    block_m, block_d, block_dv = (max(16, triton.next_power_of_2(n)) for n in (group, D, DV))
    block_n, warps, stages = LUT_TILES
    split_size, n_splits = split_plan(T, B * H, query.device, block_n)
    n_member_splits = max(1, triton.cdiv(E, MEMBER_BLOCK))  # >= 1: launch 3's first split stores M
    f32 = dict(dtype=torch.float32, device=query.device)
    logits, norms = torch.empty(B, Hq, T, **f32), torch.empty(B, H, T, **f32)
    slot_max, member_max = torch.empty(B, Hq, n_splits, **f32), torch.empty(B, Hq, n_member_splits, **f32)
    member_logits, member_weights = torch.empty(B, Hq, E, **f32), torch.empty(B, Hq, T, **f32)  # zeroed by launch 1
    top = torch.empty(B, Hq, **f32)
    acc, sums = torch.empty(B, n_splits, Hq, block_dv, **f32), torch.empty(B, n_splits, Hq, **f32)
    lengths = lengths.contiguous()
    if lookup is None:  # no map: the map's arguments are placeholders its branches never read
        positions, centre, position_map = lengths.view(B, H, 1), lengths.view(B, H, 1), lengths
    else:  # live: a placeholder the lookup branch of launch 2 never reads
        positions, centre, position_map = lookup
        live = position_map
    limit = position_map.shape[-1]
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    members = dict(GROUP=group, BLOCK_M=triton.next_power_of_2(group), BLOCK_E=MEMBER_BLOCK)
    maxima = dict(BLOCK_S=triton.next_power_of_2(n_splits), BLOCK_SE=triton.next_power_of_2(n_member_splits))
    _slot_logits[(n_splits, B * H)](
        query, keys, lengths, logits, norms, slot_max, member_weights, positions, position_map, query.stride(0),
        query.stride(1), query.stride(3), *keys.stride(), *positions.stride(), H, T, D, split_size, n_splits, scaling,
        limit, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, EVEN_D=D == block_d,
        UPCAST=INTERPRETED, PRECISION=precision, LOOKUP=lookup is not None, num_warps=warps, num_stages=stages,
    )
    _member_logits[(n_member_splits, B * H)](
        logits, norms, member_slot, member_norm.float().contiguous(), live, member_logits, member_max, position_map,
        positions, centre, lengths, *positions.stride(), *centre.stride(), H, T, E, n_member_splits, NORM_EPS, limit,
        LOOKUP=lookup is not None, **members,
    )
    _member_weights[(n_member_splits, B * H)](
        member_slot, member_logits, slot_max, member_max, top, member_weights, T, E, n_splits, n_member_splits,
        **members, **maxima,
    )
    _weighted_values[(n_splits, B * H)](
        values, logits, member_weights, top, acc, sums, *values.stride(), H, T, DV, split_size, n_splits,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DV=block_dv, EVEN_D=DV == block_dv,
        WANT_STEP=want_step, UPCAST=INTERPRETED, PRECISION=precision, num_warps=warps, num_stages=stages,
    )
    out = query.new_empty(B, Hq, 1, DV)
    combine = dict(GROUP=group, BLOCK_M=block_m, BLOCK_DV=block_dv, BLOCK_T=COMBINE_BLOCK, BLOCK_S=maxima["BLOCK_S"])
    _combine[(1, B * H)](acc, sums, logits, out, out, H, T, DV, n_splits, 1.0 / group, WANT_OUT=True,
                         WANT_STEP=False, **combine)
    if not want_step:
        return out, None

    def step_attention(into: Tensor | None = None) -> Tensor:
        step = torch.empty(B, H, T, **f32)
        _combine[(triton.cdiv(T, COMBINE_BLOCK), B * H)](acc, sums, logits, out, step, H, T, DV, n_splits, 1.0 / group,
                                                        WANT_OUT=False, WANT_STEP=True, **combine)
        return pending_step(step)(into)

    return out, step_attention if defer_step else step_attention()
