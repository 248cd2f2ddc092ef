"""Triton twin of ``decode_attention.decode_attention``: split-K (flash-decoding) attention of one query per row.

A decode step reads the whole cache once and does little arithmetic, so the work is split over the key axis:
one program per (key split, b, kv head) runs the online softmax over its slots for every query head of the
GQA group at once (the group's heads are the rows of one tile, so each K/V tile is read once), and writes its
partial (max, sum, weighted values); a second kernel combines the splits into the output and the
log-sum-exp, one program per query head reducing all its splits in one tile. With statistics wanted, the first
kernel also writes every slot's logit (-inf past the row's length), and a third (``_step_attention``) makes the
step attention, exp(logit - lse) averaged over the group, in one pass: bit for bit what the torch operations it
replaced gave on CUDA (``exp(logits - lse.nan_to_num(neginf=0)).view(B, H_kv, group, C).mean(2)``, four
kernels and a fill; libdevice's exp, as torch's, not Triton's approximate one; the heads summed in torch's
order, times float32 1/group, as torch's mean). Every method that observes its decode steps (H2O, TOVA, CaM,
D2O, WeightedKV) reads it.

The grid depends only on the storage's capacity and the ``span`` the host passes, never on a device value:
programs whose split lies past a row's length exit after one comparison, so a captured CUDA graph replays
correctly while rows grow and shrink. Compiled, half tiles multiply natively (float32 accumulation; the
probabilities are rounded to the value dtype for the second product, as FlashDecoding does), so K and V go
from memory to the tensor cores untouched; float32 inputs multiply in full float32. Under the CPU interpreter
inputs are cast to float32 after loading (it computes garbage on bfloat16).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# slots per tile, warps, pipeline stages of the partials kernel; and programs per multiprocessor the split
# plan aims at (scripts/bench_attention.py times the alternatives at 32k)
DECODE_TILES = (64, 4, 3)
WAVES = 2


@triton.jit
def _decode_partials(
    q_ptr, k_ptr, v_ptr, len_ptr, bias_ptr, logit_ptr, m_ptr, l_ptr, acc_ptr,
    sqb, sqh, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sbb, sbh, sbt,
    H_kv, C, span, D, DV, split_size, n_splits, scale_log2,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, HAS_BIAS: tl.constexpr, WANT_LOGITS: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    split, pid_bh = tl.program_id(0), tl.program_id(1)
    b, hkv = pid_bh // H_kv, pid_bh % H_kv
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP
    hq = hkv * GROUP + rows
    d, dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b * sqb + hq[:, None] * sqh + d[None, :] * sqd,
                mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    length = tl.load(len_ptr + pid_bh)
    start = split * split_size
    split_end = tl.minimum(start + split_size, span)
    stop = split_end if WANT_LOGITS else tl.minimum(split_end, length)  # logits past the length: -inf
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        real = cols < tl.minimum(length, split_end)
        k_ptrs = k_ptr + b * skb + hkv * skh + cols[:, None] * skt + d[None, :] * skd
        v_ptrs = v_ptr + b * svb + hkv * svh + cols[:, None] * svt + dv[None, :] * svd
        if EVEN_D:
            k = tl.load(k_ptrs, mask=real[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=real[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=real[:, None] & (d[None, :] < D), other=0.0)
            v = tl.load(v_ptrs, mask=real[:, None] & (dv[None, :] < DV), other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if HAS_BIAS:
            bias = tl.load(bias_ptr + b * sbb + hkv * sbh + cols * sbt, mask=real, other=0.0).to(tl.float32)
            s += bias[None, :] * 1.4426950408889634
        s = tl.where(real[None, :], s, float("-inf"))
        if WANT_LOGITS:
            tl.store(logit_ptr + (b * H_kv * GROUP + hq[:, None]) * C + cols[None, :], s * 0.6931471805599453,
                     mask=row_ok[:, None] & (cols[None, :] < split_end))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    # partials laid out (b, query head, split) so that the combine reads one head's splits contiguously
    part = (b * H_kv * GROUP + hq) * n_splits + split
    tl.store(m_ptr + part, m_i, mask=row_ok)
    tl.store(l_ptr + part, l_i, mask=row_ok)
    tl.store(acc_ptr + part[:, None] * BLOCK_DV + dv[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _decode_combine(
    m_ptr, l_ptr, acc_ptr, out_ptr, lse_ptr, sob, soh, sod, Hq, DV, n_splits,
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """One program per (b, query head): all its splits at once (n_splits <= BLOCK_S)."""
    row = tl.program_id(0)
    b, hq = row // Hq, row % Hq
    splits = tl.arange(0, BLOCK_S)
    ok = splits < n_splits
    dv = tl.arange(0, BLOCK_DV)
    m = tl.load(m_ptr + row * n_splits + splits, mask=ok, other=float("-inf"))
    top = tl.max(m, 0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    scale = tl.where(ok, tl.exp2(m - top_safe), 0.0)
    total = tl.sum(scale * tl.load(l_ptr + row * n_splits + splits, mask=ok, other=0.0), 0)
    acc = tl.load(acc_ptr + (row * n_splits + splits[:, None]) * BLOCK_DV + dv[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(acc * scale[:, None], 0) / tl.maximum(total, 1e-30)
    out = tl.where(total > 0, out, 0.0)
    tl.store(out_ptr + b * sob + hq * soh + dv * sod, out.to(out_ptr.dtype.element_ty), mask=dv < DV)
    lse = tl.where(total > 0, (top + tl.log2(tl.maximum(total, 1e-30))) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + row, lse)


@triton.jit
def step_mean(logit_ptr, lse_ptr, row, c, C, span, factor, GROUP: tl.constexpr, BLOCK: tl.constexpr,
              EXACT_EXP: tl.constexpr):
    """(BLOCK,) the step attention of slots ``c`` of row ``row`` (b * H_kv + kv head): the mean over the group's
    query heads of exp(logit - lse), the heads summed in torch's order and the sum times ``factor`` (float32
    1/GROUP), as torch's mean; an lse that is -inf or NaN counts as 0 and +inf as the largest float
    (``nan_to_num``); slots from ``span`` on are 0 (their logits are not written). EXACT_EXP: libdevice's exp
    (torch's on CUDA); the interpreter has numpy's. A launch that adds to it turns floating-point contraction off:
    the mean is rounded before the addition, as torch's."""
    # torch's reduction keeps four partial sums (head g in sum g % 4), added in order at the end
    sum0 = tl.zeros((BLOCK,), tl.float32)
    sum1 = tl.zeros((BLOCK,), tl.float32)
    sum2 = tl.zeros((BLOCK,), tl.float32)
    sum3 = tl.zeros((BLOCK,), tl.float32)
    for g in tl.static_range(GROUP):
        head = row * GROUP + g  # (b * H_q + query head): the group's heads are consecutive
        lse = tl.load(lse_ptr + head)
        lse = tl.where((lse != lse) | (lse == float("-inf")), 0.0, lse)
        lse = tl.where(lse == float("inf"), 3.4028234663852886e38, lse)
        shifted = tl.load(logit_ptr + head * C + c, mask=c < span, other=float("-inf")) - lse
        if EXACT_EXP:
            p = libdevice.exp(shifted)
        else:
            p = tl.exp(shifted)
        if g % 4 == 0:
            sum0 += p
        elif g % 4 == 1:
            sum1 += p
        elif g % 4 == 2:
            sum2 += p
        else:
            sum3 += p
    return (((sum0 + sum1) + sum2) + sum3) * factor


@triton.jit
def _step_attention(logit_ptr, lse_ptr, out_ptr, C, span, factor, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                    EXACT_EXP: tl.constexpr, ACCUMULATE: tl.constexpr):
    """One program per (block of slots, b * H_kv + kv head): ``step_mean``, stored; ACCUMULATE: added to what
    ``out`` holds (one float32 addition, as torch's ``add_``)."""
    block, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    c = block * BLOCK + tl.arange(0, BLOCK)
    mean = step_mean(logit_ptr, lse_ptr, row, c, C, span, factor, GROUP, BLOCK, EXACT_EXP)
    if ACCUMULATE:
        mean += tl.load(out_ptr + row * C + c, mask=c < C, other=0.0)
    tl.store(out_ptr + row * C + c, mean, mask=c < C)


STEP_BLOCK = 1024  # slots per program of ``_step_attention``


def step_attention(logits: Tensor, lse: Tensor, group: int, span: int, into: Tensor | None = None) -> Tensor:
    """(B, H_kv, C) float32: exp(logits - lse) averaged over each group of ``group`` query heads. logits:
    (B, H_q, C) float32, read up to ``span`` (0 from there); lse: (B, H_q). ``into``: a tensor the step attention
    is added to, in place, and returned (``AttentionStats.add_step_to``: H2O's, CaM's and D2O's running scores);
    a contiguous float32 one by the kernel itself: bit for bit the step made, then ``into.add_(step)``."""
    B, Hq, C = logits.shape
    if into is not None and not (into.shape == (B, Hq // group, C) and into.dtype == torch.float32
                                 and into.is_contiguous()):
        return into.add_(step_attention(logits, lse, group, span))
    out = logits.new_empty(B, Hq // group, C) if into is None else into
    _step_attention[(triton.cdiv(C, STEP_BLOCK), B * (Hq // group))](
        logits, lse.contiguous(), out, C, span, group_mean_factor(group), GROUP=group, BLOCK=STEP_BLOCK,
        EXACT_EXP=not INTERPRETED, ACCUMULATE=into is not None, enable_fp_fusion=False)
    return out


def group_mean_factor(group: int) -> float:
    """float32 1 / group: the factor torch's mean over ``group`` heads multiplies by."""
    return float(np.float32(1) / np.float32(group))


@dataclass(frozen=True)
class PendingStep:
    """A one-query pass's step attention not made yet (``AttentionStats.pending_step``): called, ``step_attention``
    of the pass's ``logits`` and ``lse``; with ``into=``, added to that tensor in place. A method's eviction may
    make it inside its own first launch instead (``triton_d2o_step``), from these fields."""
    logits: Tensor
    lse: Tensor
    group: int
    span: int

    def __call__(self, into: Tensor | None = None) -> Tensor:
        return step_attention(self.logits, self.lse, self.group, self.span, into)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors (1 off CUDA, where the interpreter runs one program at a time)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@functools.cache
def _programs_wanted(device: torch.device) -> int:
    """``WAVES`` programs per multiprocessor: enough splits to keep every multiprocessor streaming the cache."""
    if device.type != "cuda":
        return 8
    return WAVES * multiprocessors(device)


MAX_SPLITS = 64  # the combine reduces all of a head's splits in one tile


def split_plan(span: int, rows: int, device: torch.device, block_n: int) -> tuple[int, int]:
    """(split_size, n_splits) for ``rows`` = B * H_kv programs per split over ``span`` slots, each split whole
    tiles of ``block_n`` slots."""
    tiles = max(1, triton.cdiv(span, block_n))
    n_splits = max(1, min(tiles, MAX_SPLITS, triton.cdiv(_programs_wanted(device), rows)))
    split_size = triton.cdiv(tiles, n_splits) * block_n
    return split_size, triton.cdiv(span, split_size) if span else 1


def combine_splits(m: Tensor, l: Tensor, acc: Tensor, out: Tensor, n_splits: int) -> tuple[Tensor, Tensor]:
    """``_decode_combine`` of split partials laid out (b, query head, split): m and l (B * H_q * n_splits,) float32,
    base 2, acc (B * H_q * n_splits, BLOCK_DV). Writes the output into ``out`` (B, H_q, 1, D_v) and returns it with
    each query head's log-sum-exp (B, H_q) float32 (natural log; -inf for a row with no slot, whose output is 0)."""
    B, Hq, DV = out.shape[0], out.shape[1], out.shape[-1]
    lse = torch.empty(B, Hq, dtype=torch.float32, device=out.device)
    _decode_combine[(B * Hq,)](m, l, acc, out, lse, out.stride(0), out.stride(1), out.stride(3), Hq, DV, n_splits,
                               BLOCK_S=max(2, triton.next_power_of_2(n_splits)), BLOCK_DV=acc.shape[-1])
    return out, lse


def decode_attention(
    query: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, positions: Tensor, query_pos: Tensor,
    scaling: float, span: int, want_step: bool = False, key_bias: Tensor | None = None, defer_step: bool = False,
) -> tuple[Tensor, Tensor | Callable[..., Tensor] | None]:
    """Triton ``decode_attention.decode_attention`` (``positions``/``query_pos`` are unused: every real slot
    precedes the decode query). Deferred, ``_step_attention`` is the callable's launch: off a decode step's
    critical path, where only the output is waited for."""
    B, Hq, _, D = query.shape
    Hkv, C, DV = keys.shape[1], keys.shape[2], values.shape[-1]
    group = Hq // Hkv
    block_m, block_dv = max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(DV))
    block_n, warps, stages = DECODE_TILES  # read at the call: scripts/bench_attention.py sweeps them
    split_size, n_splits = split_plan(span, B * Hkv, query.device, block_n)
    m = torch.empty(B * Hq * n_splits, dtype=torch.float32, device=query.device)
    l = torch.empty_like(m)
    acc = torch.empty(B * Hq * n_splits, block_dv, dtype=torch.float32, device=query.device)
    logits = torch.empty(B, Hq, C, dtype=torch.float32, device=query.device) if want_step else m
    bias = key_bias if key_bias is not None else m
    bias_strides = key_bias.stride() if key_bias is not None else (0, 0, 0)
    lengths = lengths.contiguous()
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    block_d = max(16, triton.next_power_of_2(D))
    _decode_partials[(n_splits, B * Hkv)](
        query, keys, values, lengths, bias, logits, m, l, acc,
        query.stride(0), query.stride(1), query.stride(3), *keys.stride(), *values.stride(), *bias_strides,
        Hkv, C, span, D, DV, split_size, n_splits, scaling * LOG2E,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        EVEN_D=D == block_d and DV == block_dv, HAS_BIAS=key_bias is not None, WANT_LOGITS=want_step,
        UPCAST=INTERPRETED, PRECISION=precision, num_warps=warps, num_stages=stages,
    )
    out, lse = combine_splits(m, l, acc, query.new_empty(B, Hq, 1, DV), n_splits)
    if not want_step:
        return out, None
    step = PendingStep(logits, lse, group, span)
    return out, step if defer_step else step()
