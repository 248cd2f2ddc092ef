"""Triton twin of ``lut_attention.lut_attention``: EMS's one-query attention over stored slots and LUT members
in three launches, reading K once, V once and the table once per query head.

1. ``_slot_logits``, one program per (key split, b, kv head), every query head of the GQA group as a row of
   one tile (as ``triton_decode``): the stored logits l_c (B, H_q, T) float32, -inf past the row's length,
   and the stored keys' norms (B, H, T) float32;
2. ``_member_weights``, one program per (b, query head): the largest logit M over the stored logits and the
   members' rho_j l_c (gathered from launch 1's buffers), then the softmax sum
   sum_c exp(l_c - M) + sum_j exp(rho_j l_c - M), and each member's weight added onto its centre's slot
   (float32 atomic adds into a zeroed (B, H_q, T) buffer, in any order, as ``fold_entries`` does);
3. ``_weighted_values``, one program per (key split, b, kv head): W_c = exp(l_c - M) + the members' weights,
   p_c = W_c / sum, the partial sum_c p_c v_c of its split (summed over splits by torch: deterministic) and the
   step attention p_c averaged over the group.
The grids depend on the storage's capacity and the table's size only: a captured CUDA graph replays while rows
grow and shrink. Under the CPU interpreter, inputs are cast to float32 after loading (``triton_decode``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvbench.kernels.lut_attention import NORM_EPS
from kvbench.kernels.triton_decode import DECODE_TILES, INTERPRETED, split_plan

MEMBER_BLOCK = 256  # table entries (and stored logits) per iteration of the members' program


@triton.jit
def _slot_logits(
    q_ptr, k_ptr, len_ptr, logit_ptr, norm_ptr,
    sqb, sqh, sqd, skb, skh, skt, skd,
    H, T, D, split_size, scaling,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
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
                    mask=real[:, None] & (d[None, :] < D), other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling
        s = tl.where(real[None, :], s, float("-inf"))
        tl.store(logit_ptr + (b * H * GROUP + hq[:, None]) * T + cols[None, :], s,
                 mask=head_ok[:, None] & inside[None, :])
        kf = k.to(tl.float32)
        tl.store(norm_ptr + row * T + cols, tl.sqrt(tl.sum(kf * kf, axis=1)), mask=inside)


@triton.jit
def _member_logits(logits, norms, member_norms, slot, live, norm_eps):
    """rho_j l_c of a block of members (-inf where not live): l_c and ||k_c|| gathered at their centre's slot."""
    rho = tl.load(member_norms, mask=live, other=0.0) / tl.maximum(tl.load(norms + slot, mask=live, other=1.0),
                                                                   norm_eps)
    return tl.where(live, rho * tl.load(logits + slot, mask=live, other=0.0), float("-inf"))


@triton.jit
def _member_weights(
    logit_ptr, norm_ptr, slot_ptr, mnorm_ptr, live_ptr, mweight_ptr, top_ptr, total_ptr,
    T, E, norm_eps,
    GROUP: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # (b, query head)
    kv_row = row // GROUP  # (b, kv head): rows of H_q = GROUP * H query heads, kv head = query head // GROUP
    logits = logit_ptr + row * T
    tops = tl.full((BLOCK,), float("-inf"), tl.float32)
    for n0 in range(0, T, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        tops = tl.maximum(tops, tl.load(logits + cols, mask=cols < T, other=float("-inf")))
    for e0 in range(0, E, BLOCK):
        j = e0 + tl.arange(0, BLOCK)
        live = tl.load(live_ptr + kv_row * E + j, mask=j < E, other=0) != 0
        slot = tl.load(slot_ptr + kv_row * E + j, mask=live, other=0)
        tops = tl.maximum(tops, _member_logits(logits, norm_ptr + kv_row * T, mnorm_ptr + kv_row * E + j, slot, live,
                                               norm_eps))
    top = tl.max(tops, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # an empty row: no weight anywhere
    totals = tl.zeros((BLOCK,), tl.float32)
    for n0 in range(0, T, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        totals += tl.exp(tl.load(logits + cols, mask=cols < T, other=float("-inf")) - top)
    for e0 in range(0, E, BLOCK):
        j = e0 + tl.arange(0, BLOCK)
        live = tl.load(live_ptr + kv_row * E + j, mask=j < E, other=0) != 0
        slot = tl.load(slot_ptr + kv_row * E + j, mask=live, other=0)
        weight = tl.exp(_member_logits(logits, norm_ptr + kv_row * T, mnorm_ptr + kv_row * E + j, slot, live,
                                       norm_eps) - top)
        totals += weight
        tl.atomic_add(mweight_ptr + row * T + slot, weight, mask=live)
    total = tl.sum(totals, 0)
    tl.store(top_ptr + row, top)
    tl.store(total_ptr + row, total)


@triton.jit
def _weighted_values(
    v_ptr, logit_ptr, mweight_ptr, top_ptr, total_ptr, acc_ptr, step_ptr,
    svb, svh, svt, svd,
    H, T, DV, split_size, n_splits,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
    WANT_STEP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    split, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = row // H, row % H
    heads = tl.arange(0, BLOCK_M)
    head_ok = heads < GROUP
    q_rows = row * GROUP + heads  # (b, query head) rows of the buffers
    top = tl.load(top_ptr + q_rows, mask=head_ok, other=0.0)
    total = tl.maximum(tl.load(total_ptr + q_rows, mask=head_ok, other=1.0), 1e-30)
    dv = tl.arange(0, BLOCK_DV)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    start = split * split_size
    for n0 in range(start, tl.minimum(start + split_size, T), BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        inside = cols < T
        at = q_rows[:, None] * T + cols[None, :]
        tile = head_ok[:, None] & inside[None, :]
        logit = tl.load(logit_ptr + at, mask=tile, other=float("-inf"))
        weight = tl.exp(logit - top[:, None]) + tl.load(mweight_ptr + at, mask=tile, other=0.0)
        p = weight / total[:, None]
        v = tl.load(v_ptr + b * svb + h * svh + cols[:, None] * svt + dv[None, :] * svd,
                    mask=inside[:, None] & (dv[None, :] < DV), other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc += tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        if WANT_STEP:
            tl.store(step_ptr + row * T + cols, tl.sum(p, 0) / GROUP, mask=inside)
    # partials laid out (b, split, query head): torch sums them over the splits
    tl.store(acc_ptr + (((b * n_splits + split) * H + h) * GROUP + heads[:, None]) * BLOCK_DV + dv[None, :], acc,
             mask=head_ok[:, None])


def lut_attention(query: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, member_slot: Tensor,
                  member_norm: Tensor, live: Tensor, scaling: float, want_step: bool = False,
                  ) -> tuple[Tensor, Tensor | None]:
    """Triton ``lut_attention.lut_attention``."""
    B, Hq, _, D = query.shape
    H, T, DV, E = keys.shape[1], keys.shape[2], values.shape[-1], member_slot.shape[-1]
    group = Hq // H
    block_m, block_d, block_dv = (max(16, triton.next_power_of_2(n)) for n in (group, D, DV))
    block_n, warps, stages = DECODE_TILES
    split_size, n_splits = split_plan(T, B * H, query.device)
    f32 = dict(dtype=torch.float32, device=query.device)
    logits, norms = torch.empty(B, Hq, T, **f32), torch.empty(B, H, T, **f32)
    member_weights = torch.zeros(B, Hq, T, **f32)
    top, total = torch.empty(B, Hq, **f32), torch.empty(B, Hq, **f32)
    acc = torch.empty(B, n_splits, Hq, block_dv, **f32)
    step = torch.empty(B, H, T, **f32) if want_step else acc
    lengths = lengths.contiguous()
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    _slot_logits[(n_splits, B * H)](
        query, keys, lengths, logits, norms, query.stride(0), query.stride(1), query.stride(3), *keys.stride(),
        H, T, D, split_size, scaling,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, UPCAST=INTERPRETED, PRECISION=precision,
        num_warps=warps, num_stages=stages,
    )
    _member_weights[(B * Hq,)](
        logits, norms, member_slot.contiguous(), member_norm.float().contiguous(), live.to(torch.int8).contiguous(),
        member_weights, top, total, T, E, NORM_EPS, GROUP=group, BLOCK=MEMBER_BLOCK,
    )
    _weighted_values[(n_splits, B * H)](
        values, logits, member_weights, top, total, acc, step, *values.stride(), H, T, DV, split_size, n_splits,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DV=block_dv, WANT_STEP=want_step,
        UPCAST=INTERPRETED, PRECISION=precision, num_warps=warps, num_stages=stages,
    )
    out = acc.sum(1)[..., :DV].to(query.dtype).view(B, Hq, 1, DV)
    return out, step if want_step else None
