"""Triton twin of ``chunk_attention.chunk_attention``: a FlashAttention-2 forward of a pass's q new tokens
over a ragged cache whose last q real slots per row are the pass's own.

One program per (row tile, b, kv head). Rows are query-major, r = i * GROUP + g (query i, head g of the GQA
group), so a tile holds consecutive queries of every head of the group and each K/V tile is read once for
them all. The visibility rule (slot s seen by query i iff s <= lengths - q + i) splits each program's key
loop in two: the slots every query of the tile sees (the cached slots and the start of the pass's own), with
no mask at all, then the few tiles on the causal diagonal, masked; nothing past the tile's last query is
read. Under the CPU interpreter half inputs are cast to float32 after loading (it computes garbage on
bfloat16); compiled, the tiles multiply natively (float32 accumulation) and the probabilities are rounded to
the value dtype for the second product, as FlashAttention does.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = 1.4426950408889634
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# (rows per tile, keys per tile, warps, pipeline stages); small tiles under the interpreter so that the
# tests' odd shapes cross tile edges
TILES = (32, 32, 4, 1) if INTERPRETED else (128, 64, 8, 3)


@triton.jit
def _softmax_step(q, k, v, bias, visible, m_i, l_i, acc, scale_log2,
                  HAS_BIAS: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile of the online softmax: (m_i, l_i, acc) updated with logits q k^T (base 2)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    if HAS_BIAS:
        s += bias[None, :] * 1.4426950408889634
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:  # a row that has seen nothing yet keeps m = -inf: subtract 0 instead
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    alpha = tl.exp2(m_i - m_new_safe)
    p = tl.exp2(s - m_new_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _chunk_fwd(
    q_ptr, k_ptr, v_ptr, len_ptr, bias_ptr, out_ptr, lse_ptr,
    sqb, sqh, sqq, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sbb, sbh, sbt, sob, soh, soq, sod,
    H_kv, Q, D, DV, scale_log2,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile, pid_bh = tl.program_id(0), tl.program_id(1)
    b, hkv = pid_bh // H_kv, pid_bh % H_kv
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    qi, hq = rows // GROUP, hkv * GROUP + rows % GROUP
    row_ok = qi < Q
    d, dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b * sqb + hq[:, None] * sqh + qi[:, None] * sqq + d[None, :] * sqd,
                mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_row, v_row = k_ptr + b * skb + hkv * skh, v_ptr + b * svb + hkv * svh
    bias_row = bias_ptr + b * sbb + hkv * sbh
    last_cached = tl.load(len_ptr + pid_bh) - Q  # query i sees slots s <= last_cached + i
    first_q = tile * BLOCK_M // GROUP
    last_q = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, Q - 1)
    seen_by_all = (last_cached + first_q + 1) // BLOCK_N * BLOCK_N  # tiles before this: no mask
    end = last_cached + last_q + 1
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    bias = tl.zeros((BLOCK_N,), tl.float32)
    for start in range(0, seen_by_all, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        if EVEN_D:  # the hot loop: no mask at all
            k = tl.load(k_row + cols[:, None] * skt + d[None, :] * skd)
            v = tl.load(v_row + cols[:, None] * svt + dv[None, :] * svd)
        else:
            k = tl.load(k_row + cols[:, None] * skt + d[None, :] * skd, mask=d[None, :] < D, other=0.0)
            v = tl.load(v_row + cols[:, None] * svt + dv[None, :] * svd, mask=dv[None, :] < DV, other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_row + cols * sbt).to(tl.float32)
        m_i, l_i, acc = _softmax_step(q, k, v, bias, None, m_i, l_i, acc, scale_log2,
                                      HAS_BIAS=HAS_BIAS, MASKED=False, PRECISION=PRECISION)
    for start in range(seen_by_all, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        real = cols < end
        k = tl.load(k_row + cols[:, None] * skt + d[None, :] * skd, mask=real[:, None] & (d[None, :] < D), other=0.0)
        v = tl.load(v_row + cols[:, None] * svt + dv[None, :] * svd, mask=real[:, None] & (dv[None, :] < DV),
                    other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_row + cols * sbt, mask=real, other=0.0).to(tl.float32)
        visible = cols[None, :] <= (last_cached + qi)[:, None]
        m_i, l_i, acc = _softmax_step(q, k, v, bias, visible, m_i, l_i, acc, scale_log2,
                                      HAS_BIAS=HAS_BIAS, MASKED=True, PRECISION=PRECISION)
    # every real query sees at least its own slot: l_i > 0
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    tl.store(lse_ptr + (b * H_kv * GROUP + hq) * Q + qi, lse, mask=row_ok)
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * sob + hq[:, None] * soh + qi[:, None] * soq + dv[None, :] * sod,
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def chunk_attention(
    query: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, scaling: float, key_bias: Tensor | None = None,
    chunk: int = 512,
) -> tuple[Tensor, Tensor]:
    """Triton ``chunk_attention.chunk_attention`` (``chunk`` is the reference's memory knob). The output is a
    (B, H_q, q, D_v) view of a (B, q, H_q, D_v) tensor: the layout the model's output projection reads."""
    B, Hq, Q, D = query.shape
    Hkv, DV = keys.shape[1], values.shape[-1]
    group = Hq // Hkv
    block_m, block_n, warps, stages = TILES
    block_m = min(block_m, _block(Q * group))
    out = query.new_empty(B, Q, Hq, DV).transpose(1, 2)
    lse = torch.empty(B, Hq, Q, dtype=torch.float32, device=query.device)
    bias = key_bias if key_bias is not None else lse
    bias_strides = key_bias.stride() if key_bias is not None else (0, 0, 0)
    _chunk_fwd[(triton.cdiv(Q * group, block_m), B * Hkv)](
        query, keys, values, lengths.contiguous(), bias, out, lse,
        *query.stride(), *keys.stride(), *values.stride(), *bias_strides, *out.stride(),
        Hkv, Q, D, DV, scaling * LOG2E,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_block(D), BLOCK_DV=_block(DV),
        EVEN_D=D == _block(D) and DV == _block(DV), HAS_BIAS=key_bias is not None, UPCAST=INTERPRETED, PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages,
    )
    return out, lse
