"""Triton twin of ``lut_attention.lut_attention``: EMS's one-query attention over stored slots and LUT members
in four launches, reading K once, V once and the table once, every launch split over slots or table entries
(a program per (split, b, kv head), every query head of the GQA group a row of its tiles, as ``triton_decode``).

Slot c and its live members j weigh exp(l_c) + sum_j exp(rho_j l_c) = exp(z_c) in the softmax, with
    z_c = l_c + log(1 + u_c),  u_c = sum_j exp(t_j),  t_j = rho_j l_c - l_c
(each member's logit against its own centre's), so the members need no row-wide maximum: they only add their
exp(t_j) onto their slot, and the slots then attend as a one-query split-K attention with logits z_c:
1. ``_slot_logits``, over key splits: l_c (B, H_q, T) float32 (-inf past the row's length), the stored keys'
   norms (B, H, T), and zeros in the member sums u (``lut_attention_at_centres``: also every real slot at its
   position in ``centre_slots``' position map);
2. ``_member_sums``, over table splits: each live member's exp(t_j) added onto its centre's slot (float64 relaxed
   atomic adds, in any order; ``lut_attention_at_centres``: each member's centre slot and liveness read through
   the map first);
3. ``_cluster_values``, over key splits: z_c and the split's largest, then the split's sum of exp(z - that) and
   of those weights times V (``triton_decode``'s partials), z over launch 1's logits when the step attention is
   wanted;
4. ``triton_decode.combine_splits``: the output and each query head's log-sum-exp, from which
   ``triton_decode.step_attention`` makes the step attention exp(z - lse) averaged over the group, in one more
   launch that can wait for the caller (``defer_step``): a decode step waits only for the output.
Range and rounding. u is summed in float64 as sum_j exp(t_j) * 2^-SCALE_BITS (``_scaled_exp``): a member may lie
up to about 1,330 nats above its centre's logit, and those more than about 87 below it (weighing under e^-87 of
their centre's own term, which float32 cannot hold beside it anyway) count 0. Each weight is float32's exp2 of its
fraction, as ``tl.exp`` rounds; z_c = l_c + log(1 + u_c) with the log in float32 (``_log_one_plus``): an error of
about float32's unit in the exponent of the cluster's weight, as l_c's own rounding makes. So output and step
attention agree with the reference to float32 rounding (the Triton tests: 1e-5 relative), and u's float64 sums,
in the atomics' order, round to the same z nearly always.
The five launches this replaced weighed every member against the row's largest logit in float32: that needed the
maximum before any member's weight (a launch of its own between the members' logits and their weights) and a combine
of their own. On an H200, as a decode step calls it (``lut_attention_at_centres``, graph replay, one process;
``results/gpu/2026-11-30/logs/s21_call4_bench.txt``): 47.0 -> 39.7 us at 1 x 8 x 6,555 slots (32k), 79.3 -> 78.6 at
1 x 8 x 13,108 (64k), 395.5 -> 370.0 at 32 x 8 x 3,277; EMS's 32k TPOT / full 1.08-1.12 -> 1.06. Launch 3 weighing
its tiles by an online softmax instead (no first pass for the split's largest z) took 15.6 us against 11.2 at 32k.
A member pass of one program per row would loop over the whole table with dependent gathers (latency-bound at tens
of thousands of entries); split, every launch is a few iterations per program. The grids depend on the storage's
capacity and the table's size only: a captured CUDA graph replays while rows grow and shrink. Under the CPU
interpreter, inputs are cast to float32 after loading (``triton_decode``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvbench.kernels.lut_attention import NORM_EPS
from kvbench.kernels.triton_decode import INTERPRETED, PendingStep, combine_splits, multiprocessors, split_plan
from kvbench.kernels.triton_lut_expand import map_positions, mapped_centres

# (slots a tile, warps, stages) of launches 1 and 3: on an H200 at 32 rows x 8 heads x 3,277 slots, the values'
# launch took 94 us with 128-slot tiles against 185 with ``triton_decode.DECODE_TILES``' 64 (launch 1: 110 against 108)
LUT_TILES = (128, 4, 3)
# Launch 2's table entries a program: the smallest of MEMBER_BLOCKS that keeps its programs within
# MEMBER_PROGRAMS_PER_SM a multiprocessor. On an H200, EMS's replayed 32k steps (1 row x 8 heads, 17.7k members a
# head: 560 programs of 256 entries) took 6.63 ms against 6.73 with 1,024 entries a program, and the 64k call 75.5
# against 79.3 us; at 32 rows x 8 heads x 8.8k members, 256 entries (8,960 programs) made the call 392.8 us against
# 371.6 with 1,024 (2,304 programs) (results/gpu/2026-11-30, twenty-second session, calls 1-3).
MEMBER_BLOCKS, MEMBER_PROGRAMS_PER_SM, MEMBER_WARPS = (256, 512, 1024), 16, 4
SCALE_BITS = tl.constexpr(896)  # the member sums hold sum_j exp(t_j) * 2^-SCALE_BITS (see Range)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _scaled_exp(t):
    """float64 exp(t) * 2^-SCALE_BITS of float32 ``t``: float32's exp2 of t's fraction (in binary orders) times the
    power of two built from its bits: 0 below t = -87.3 and inf above 1,330 (in nats). No float64 transcendental
    (float64's exp and log over whole tiles made launch 3 take 23 us against 16 at 32k on an H200) and no branch on
    the tile's range."""
    x = t * 1.4426950408889634
    whole = tl.floor(x)
    biased = whole.to(tl.int64) + (1023 - SCALE_BITS)
    power = (tl.minimum(tl.maximum(biased, 0), 2047) << 52).to(tl.float64, bitcast=True)
    return tl.exp2(x - whole).to(tl.float64) * power


@triton.jit
def _log_one_plus(members):
    """float32 log(1 + u) of u = ``members`` * 2^SCALE_BITS (float64, >= 0): float32's log of 1 + u where u is below
    2^24, else (the 1 then under u's float32 unit) u's binary order times ln 2 plus the log of its mantissa: no
    float64 transcendental either."""
    bits = members.to(tl.int64, bitcast=True)
    order = (bits >> 52) - (1023 - SCALE_BITS)
    mantissa = ((bits & 0xFFFFFFFFFFFFF) | (1023 << 52)).to(tl.float64, bitcast=True).to(tl.float32)  # [1, 2)
    scale = tl.full((), (SCALE_BITS + 1023) << 52, tl.int64).to(tl.float64, bitcast=True)  # 2^SCALE_BITS
    small = tl.log(1.0 + (members * scale).to(tl.float32))
    return tl.where(order >= 24, order.to(tl.float32) * LN2 + tl.log(mantissa), small)


@triton.jit
def _slot_logits(
    q_ptr, k_ptr, len_ptr, logit_ptr, norm_ptr, sum_ptr, pos_ptr, map_ptr,
    sqb, sqh, sqd, skb, skh, skt, skd, spb, sph, spt,
    H, T, D, split_size, scaling, LIMIT,
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
        at = (b * H * GROUP + hq[:, None]) * T + cols[None, :]
        tile = head_ok[:, None] & inside[None, :]
        tl.store(logit_ptr + at, s, mask=tile)
        tl.store(sum_ptr + at, tl.zeros((BLOCK_M, BLOCK_N), tl.float64), mask=tile)
        kf = k.to(tl.float32)
        tl.store(norm_ptr + row * T + cols, tl.sqrt(tl.sum(kf * kf, axis=1)), mask=inside)
        if LOOKUP:  # the position map launch 2 finds the members' centres in
            map_positions(map_ptr, row, cols, real & inside,
                          tl.load(pos_ptr + b * spb + h * sph + cols * spt, mask=real & inside, other=0), LIMIT)


@triton.jit
def _member_sums(
    logit_ptr, norm_ptr, slot_ptr, mnorm_ptr, live_ptr, sum_ptr, map_ptr, pos_ptr, centre_ptr, len_ptr,
    spb, sph, spt, scb, sch, sce, H, T, E, norm_eps, LIMIT,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, LOOKUP: tl.constexpr,
):
    split, row = tl.program_id(0), tl.program_id(1).to(tl.int64)  # row: (b, kv head)
    heads = tl.arange(0, BLOCK_M)
    head_ok = heads < GROUP
    q_rows = row * GROUP + heads  # (b, query head): H_q = GROUP * H, query head // GROUP = kv head
    j = split * BLOCK_E + tl.arange(0, BLOCK_E)
    if LOOKUP:  # each member's centre slot through launch 1's map
        slot, live = mapped_centres(map_ptr, pos_ptr, centre_ptr, row, row // H, row % H, j, j < E,
                                    tl.load(len_ptr + row), T, LIMIT, spb, sph, spt, scb, sch, sce)
    else:
        live = tl.load(live_ptr + row * E + j, mask=j < E, other=0) != 0
        slot = tl.load(slot_ptr + row * E + j, mask=live, other=0)
    rho = tl.load(mnorm_ptr + row * E + j, mask=live, other=0.0) / \
        tl.maximum(tl.load(norm_ptr + row * T + slot, mask=live, other=1.0), norm_eps)
    both = head_ok[:, None] & live[None, :]
    at = q_rows[:, None] * T + slot[None, :]
    at_centre = tl.load(logit_ptr + at, mask=both, other=0.0)
    t = rho[None, :] * at_centre - at_centre  # the member's float32 logit, less its centre's
    weight = _scaled_exp(t)
    # relaxed: nothing reads the sums before the launch ends. The default (acq_rel) compiles to a returning atom an
    # element, the relaxed add to a fire-and-forget red (float32: 24.2 -> 10.2 us at 1 row x 8 heads x 6,555 slots)
    tl.atomic_add(sum_ptr + at, weight, mask=both, sem="relaxed")


@triton.jit
def _cluster_logits(logit_ptr, sum_ptr, at, tile):
    """z_c = l_c + log(1 + u_c) of a tile of slots (-inf where masked)."""
    logit = tl.load(logit_ptr + at, mask=tile, other=float("-inf"))
    return logit + _log_one_plus(tl.load(sum_ptr + at, mask=tile, other=0.0))


@triton.jit
def _cluster_values(
    v_ptr, logit_ptr, sum_ptr, len_ptr, m_ptr, l_ptr, acc_ptr,
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
    dv = tl.arange(0, BLOCK_DV)
    start = split * split_size
    stop = tl.minimum(tl.minimum(start + split_size, T), tl.load(len_ptr + row))  # z past the length: l's -inf
    # the split's largest z first (a few loads of 12 bytes a slot), so that the pass over V weighs every slot against
    # it once: an online softmax's rescaling on every tile took 15.6 us at 1 x 8 x 6,555 slots on an H200
    top = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        at = q_rows[:, None] * T + cols[None, :]
        tile = head_ok[:, None] & (cols < stop)[None, :]
        z = _cluster_logits(logit_ptr, sum_ptr, at, tile)
        top = tl.maximum(top, tl.max(z, 1))
        if WANT_STEP:  # z over launch 1's logits
            tl.store(logit_ptr + at, z, mask=tile)
    top = top * 1.4426950408889634  # base 2, as ``triton_decode``'s partials hold it
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    if WANT_STEP:  # the loop below reads z as other threads of this program stored it above: once, not per tile
        tl.debug_barrier()
    for n0 in range(start, stop, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        real = cols < stop
        at = q_rows[:, None] * T + cols[None, :]
        tile = head_ok[:, None] & real[None, :]
        if WANT_STEP:
            z = tl.load(logit_ptr + at, mask=tile, other=float("-inf"))
        else:
            z = _cluster_logits(logit_ptr, sum_ptr, at, tile)
        weight = tl.exp2(z * 1.4426950408889634 - top_safe[:, None])
        total += tl.sum(weight, 1)
        v = tl.load(v_ptr + b * svb + h * svh + cols[:, None] * svt + dv[None, :] * svd,
                    mask=real[:, None] if EVEN_D else real[:, None] & (dv[None, :] < DV), other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc += tl.dot(weight.to(v.dtype), v, input_precision=PRECISION)
    # partials laid out (b, query head, split), as ``triton_decode._decode_partials`` lays them for the combine
    part = q_rows * n_splits + split
    tl.store(m_ptr + part, top, mask=head_ok)
    tl.store(l_ptr + part, total, mask=head_ok)
    tl.store(acc_ptr + part[:, None] * BLOCK_DV + dv[None, :], acc, mask=head_ok[:, None])


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
    every member's centre there and checks it; launches 2-4 then compute what they compute from ``centre_slots``'
    slots."""
    B, H = positions.shape[:2]
    lookup = (positions, centre, torch.empty(B, H, position_limit, dtype=torch.int32, device=positions.device))
    return _attend(query, keys, values, lengths, centre, member_norm, scaling, want_step, defer_step, lookup=lookup)


def _attend(query: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, member_slot: Tensor, member_norm: Tensor,
            scaling: float, want_step: bool, defer_step: bool, live: Tensor | None = None,
            lookup: tuple[Tensor, Tensor, Tensor] | None = None,
            ) -> tuple[Tensor, Tensor | Callable[..., Tensor] | None]:
    """The four launches, the members given by ``member_slot`` and ``live`` (int8), or by ``lookup`` = (positions,
    centre, position map) (``member_slot`` then only gives the table's size)."""
    B, Hq, _, D = query.shape
    H, T, DV, E = keys.shape[1], keys.shape[2], values.shape[-1], member_slot.shape[-1]
    group = Hq // H
    block_m, block_d, block_dv = (max(16, triton.next_power_of_2(n)) for n in (group, D, DV))
    block_n, warps, stages = LUT_TILES
    split_size, n_splits = split_plan(T, B * H, query.device, block_n)
    f32 = dict(dtype=torch.float32, device=query.device)
    logits, norms = torch.empty(B, Hq, T, **f32), torch.empty(B, H, T, **f32)
    member_sums = torch.empty(B, Hq, T, dtype=torch.float64, device=query.device)  # zeroed by launch 1
    m, l, acc = torch.empty(B * Hq * n_splits, **f32), torch.empty(B * Hq * n_splits, **f32), \
        torch.empty(B * Hq * n_splits, block_dv, **f32)
    lengths = lengths.contiguous()
    if lookup is None:  # no map: the map's arguments are placeholders its branches never read
        positions, centre, position_map = lengths.view(B, H, 1), lengths.view(B, H, 1), lengths
    else:  # member_slot and live: placeholders the lookup branch of launch 2 never reads
        positions, centre, position_map = lookup
        live = position_map
    limit = position_map.shape[-1]
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    _slot_logits[(n_splits, B * H)](
        query, keys, lengths, logits, norms, member_sums, positions, position_map, query.stride(0), query.stride(1),
        query.stride(3), *keys.stride(), *positions.stride(), H, T, D, split_size, scaling, limit, GROUP=group,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, EVEN_D=D == block_d, UPCAST=INTERPRETED,
        PRECISION=precision, LOOKUP=lookup is not None, num_warps=warps, num_stages=stages,
    )
    member_block = next((block for block in MEMBER_BLOCKS
                         if B * H * triton.cdiv(E, block) <= MEMBER_PROGRAMS_PER_SM * multiprocessors(query.device)),
                        MEMBER_BLOCKS[-1])
    _member_sums[(max(1, triton.cdiv(E, member_block)), B * H)](
        logits, norms, member_slot, member_norm.float().contiguous(), live, member_sums, position_map, positions,
        centre, lengths, *positions.stride(), *centre.stride(), H, T, E, NORM_EPS, limit, GROUP=group,
        BLOCK_M=triton.next_power_of_2(group), BLOCK_E=member_block, LOOKUP=lookup is not None, num_warps=MEMBER_WARPS,
    )
    _cluster_values[(n_splits, B * H)](
        values, logits, member_sums, lengths, m, l, acc, *values.stride(), H, T, DV, split_size, n_splits,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DV=block_dv, EVEN_D=DV == block_dv,
        WANT_STEP=want_step, UPCAST=INTERPRETED, PRECISION=precision, num_warps=warps, num_stages=stages,
    )
    out, lse = combine_splits(m, l, acc, query.new_empty(B, Hq, 1, DV), n_splits)
    if not want_step:
        return out, None
    step = PendingStep(logits, lse, group, T)
    return out, step if defer_step else step()
