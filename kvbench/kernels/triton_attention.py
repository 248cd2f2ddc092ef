"""Triton twins of ``column_sums.attention_lse``, ``column_sums.column_sums_from_lse`` and
``attention_stats.ragged_attention``: same signatures, same masking, float32 accumulation.

Layout shared by both kernels: the query heads of one GQA group and the queries of the pass are flattened
into one row axis r = g * Q + i (g the head inside the group, i the query), so one program reads a K/V tile
once for the whole group; during decoding (Q = 1) the group fills the rows of a tile.

- ``_attention_fwd``: one program per (row tile, b, kv head); loops over key tiles with the online softmax
  (FlashAttention-2); writes the output and each row's log-sum-exp.
- ``_column_sums``: EMS's swapped loop order: one program per (key tile, b, kv head); loops over row tiles,
  recomputes A = exp(s - lse) from the lse and sums over rows; no atomics and no (Q x T) buffer.

Masking uses one int32 tensor: a key's position, or INT32_MAX for padding slots, so "slot visible" is
``key_pos <= query_pos`` (padding queries have position -1 and see nothing).
The forward casts its inputs to float32 right after loading (tf32 dots hold fp16/bf16 mantissas exactly;
float32 inputs use full-precision dots); the column sums, the costly pass at long prompts, multiply half
tiles natively when compiled (see INTERPRETED). ``_column_sums`` skips row tiles whose queries all precede
its key tile, about half of a causal prompt's work.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvbench.kernels.triton_slots import lower_bound

LOG2E = 1.4426950408889634
# Under the CPU interpreter, half inputs are cast to float32 after loading (it stores bfloat16 as raw uint16
# and computes garbage on it); compiled kernels multiply half tiles natively (exact products, float32 sums).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_N = 64  # keys per tile
MAX_BLOCK_M = 64  # rows (group heads x queries) per tile
# column sums (keys per program, queries per tile, warps, pipeline stages): the costly pass of long prompts
COLUMN_SUMS_TILES = (64, 64, 4, 2) if INTERPRETED else (128, 64, 4, 3)  # fastest on an H100 at 32k (scripts/bench_attention.py)


@triton.jit
def _attention_fwd(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, kpos_ptr, qpos_ptr,
    sqb, sqh, sqq, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sob, soh, soq, sod,
    H_kv, Q, T, D, DV, scale_log2,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_V: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_bh = tl.program_id(1)
    b, hkv = pid_bh // H_kv, pid_bh % H_kv
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * Q
    hq, qi = hkv * GROUP + rows // Q, rows % Q
    d, dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b * sqb + hq[:, None] * sqh + qi[:, None] * sqq + d[None, :] * sqd,
                mask=row_ok[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
    qpos = tl.load(qpos_ptr + b * Q + qi, mask=row_ok, other=-1)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for start in range(0, T, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        kpos = tl.load(kpos_ptr + pid_bh * T + cols, mask=cols < T, other=2147483647)
        k = tl.load(k_ptr + b * skb + hkv * skh + cols[:, None] * skt + d[None, :] * skd,
                    mask=(cols[:, None] < T) & (d[None, :] < D), other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(kpos[None, :] <= qpos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet stay at 0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_V:
            v = tl.load(v_ptr + b * svb + hkv * svh + cols[:, None] * svt + dv[None, :] * svd,
                        mask=(cols[:, None] < T) & (dv[None, :] < DV), other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
    lse = tl.where(l_i > 0, (m_i + tl.log2(tl.maximum(l_i, 1e-30))) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + (b * H_kv * GROUP + hq) * Q + qi, lse, mask=row_ok)
    if HAS_V:
        out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
        tl.store(out_ptr + b * sob + hq[:, None] * soh + qi[:, None] * soq + dv[None, :] * sod,
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))


@triton.jit
def _column_sums(
    q_ptr, k_ptr, lse_ptr, kpos_ptr, qpos_ptr, col_ptr, win_ptr,
    sqb, sqh, sqq, sqd, skb, skh, skt, skd, slb, slh, slq,
    H_kv, Q, T, D, scale_log2, window_start,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_bh = tl.program_id(1)
    b, hkv = pid_bh // H_kv, pid_bh % H_kv
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    k = tl.load(k_ptr + b * skb + hkv * skh + cols[:, None] * skt + d[None, :] * skd,
                mask=(cols[:, None] < T) & (d[None, :] < D), other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    kpos = tl.load(kpos_ptr + pid_bh * T + cols, mask=cols < T, other=2147483647)  # padding keys: never seen
    # Queries come in position order, so those that precede every key of this tile form a prefix: find its
    # end by binary search and start there (a causal prompt skips about half of the work).
    start = (lower_bound(qpos_ptr + b * Q, Q, tl.min(kpos), SEARCH_STEPS) // BLOCK_M) * BLOCK_M
    last_key = tl.max(tl.where(cols < T, kpos, -1))
    col = tl.zeros((BLOCK_N,), tl.float32)
    win = tl.zeros((BLOCK_N,), tl.float32)
    for g in range(GROUP):
        hq = hkv * GROUP + g
        for i0 in range(start, Q, BLOCK_M):
            qi = i0 + tl.arange(0, BLOCK_M)
            row_ok = qi < Q
            q = tl.load(q_ptr + b * sqb + hq * sqh + qi[:, None] * sqq + d[None, :] * sqd,
                        mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
            qpos = tl.load(qpos_ptr + b * Q + qi, mask=row_ok, other=-1)
            lse = tl.load(lse_ptr + b * slb + hq * slh + qi * slq, mask=row_ok, other=float("inf"))
            # keys as rows: the sum over queries runs along each thread's own accumulator row (as a
            # FlashAttention forward sums its rows), not across warps
            s = tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale_log2 - lse[None, :] * 1.4426950408889634
            p = tl.exp2(s)  # padding queries have lse +inf: 0
            if tl.min(qpos) < last_key:  # a tile on the causal diagonal (or with padding queries)
                p = tl.where(kpos[:, None] <= qpos[None, :], p, 0.0)
            col += tl.sum(p, 1)
            if i0 + BLOCK_M > window_start:
                win += tl.sum(tl.where((qi >= window_start)[None, :], p, 0.0), 1)
    tl.store(col_ptr + pid_bh * T + cols, col / GROUP, mask=cols < T)
    tl.store(win_ptr + pid_bh * T + cols, win / GROUP, mask=cols < T)


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _precision(t: Tensor) -> str:
    return "ieee" if t.dtype == torch.float32 else "tf32"


def _masked_positions(key_valid: Tensor, key_pos: Tensor, query_pos: Tensor) -> tuple[Tensor, Tensor]:
    """(B, H_kv, T) int32 key positions with INT32_MAX on padding slots, and (B, Q) int32 query positions."""
    kpos = key_pos.masked_fill(~key_valid, torch.iinfo(torch.int32).max).to(torch.int32).contiguous()
    return kpos, query_pos.to(torch.int32).contiguous()


def attention_lse(
    query: Tensor, keys: Tensor, values: Tensor | None, key_valid: Tensor, key_pos: Tensor, query_pos: Tensor,
    scaling: float, chunk: int = 512,
) -> tuple[Tensor | None, Tensor]:
    """Triton ``column_sums.attention_lse`` (``chunk`` is the reference's memory knob; tiles are fixed here)."""
    B, Hq, Q, D = query.shape
    Hkv, T = keys.shape[1], keys.shape[2]
    group = Hq // Hkv
    kpos, qpos = _masked_positions(key_valid, key_pos, query_pos)
    lse = torch.empty(B, Hq, Q, dtype=torch.float32, device=query.device)
    has_v = values is not None
    v = values if has_v else keys
    out = query.new_empty(B, Hq, Q, v.shape[-1]) if has_v else lse
    o_strides = out.stride() if has_v else (0, 0, 0, 0)
    block_m = min(MAX_BLOCK_M, _block(group * Q))
    grid = (triton.cdiv(group * Q, block_m), B * Hkv)
    _attention_fwd[grid](
        query, keys, v, out, lse, kpos, qpos,
        *query.stride(), *keys.stride(), *v.stride(), *o_strides,
        Hkv, Q, T, D, v.shape[-1], scaling * LOG2E,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_D=_block(D), BLOCK_DV=_block(v.shape[-1]),
        HAS_V=has_v, PRECISION=_precision(query),
    )
    return (out if has_v else None), lse


def column_sums_from_lse(
    query: Tensor, keys: Tensor, lse: Tensor, key_valid: Tensor, key_pos: Tensor, query_pos: Tensor,
    scaling: float, window: int = 0, chunk: int = 512,
) -> tuple[Tensor, Tensor | None]:
    """Triton ``column_sums.column_sums_from_lse``: (column_sums, window_column_sums or None), (B, H_kv, T)."""
    B, Hq, Q, D = query.shape
    Hkv, T = keys.shape[1], keys.shape[2]
    group = Hq // Hkv
    kpos, qpos = _masked_positions(key_valid, key_pos, query_pos)
    col = torch.empty(B, Hkv, T, dtype=torch.float32, device=query.device)
    win = torch.empty_like(col)
    lse = lse.float()
    block_n, block_m, warps, stages = COLUMN_SUMS_TILES
    grid = (triton.cdiv(T, block_n), B * Hkv)
    _column_sums[grid](
        query, keys, lse, kpos, qpos, col, win,
        *query.stride(), *keys.stride(), *lse.stride(),
        Hkv, Q, T, D, scaling * LOG2E, Q - window if window > 0 else Q,
        GROUP=group, BLOCK_M=min(block_m, _block(Q)), BLOCK_N=block_n, BLOCK_D=_block(D),
        SEARCH_STEPS=max(1, Q.bit_length()), PRECISION=_precision(query), UPCAST=INTERPRETED,
        num_warps=warps, num_stages=stages,
    )
    return col, (win if window > 0 else None)


def ragged_attention(
    query: Tensor, keys: Tensor, values: Tensor | None, key_valid: Tensor, key_pos: Tensor, query_pos: Tensor,
    scaling: float, window: int = 0, want_column_sums: bool = False, want_step: bool = False, chunk: int = 512,
) -> tuple[Tensor | None, dict[str, Tensor]]:
    """Triton ``attention_stats.ragged_attention``: forward with lse, then the statistics from the lse."""
    out, lse = attention_lse(query, keys, values, key_valid, key_pos, query_pos, scaling)
    stats: dict[str, Tensor] = {}
    if want_column_sums or want_step or window > 0:
        col, win = column_sums_from_lse(query, keys, lse, key_valid, key_pos, query_pos, scaling, window)
        if want_column_sums:
            stats["column_sums"] = col
        if want_step:  # the pass's queries: the new token's attention at a decode step
            stats["step_attention"] = col
        if win is not None:
            stats["window_column_sums"] = win
    return out, stats
