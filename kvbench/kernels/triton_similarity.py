"""Triton twins of ``similarity.adjacent_cosine`` and ``similarity.anchor_runs`` (same signatures).

- ``_adjacent_cosine``: one program per (slot tile, b, h): loads slots t and t+1, one pass, O(T D).
- ``_anchor_joins``: one program per row (b, h) walks the row from the right keeping the anchor's unit key
  in registers: the reference's T-step Python loop of small torch ops becomes one sequential loop per row.
  The run numbering that follows is ``similarity.run_ids`` itself (a cumulative sum), not re-implemented.
Normalisation matches ``similarity.unit_keys`` (x / max(|x|, 1e-12)); inputs are cast to float32 on load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvbench.kernels.similarity import run_ids

BLOCK_T = 64


@triton.jit
def _adjacent_cosine(k_ptr, out_ptr, skb, skh, skt, skd, H, T, D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_bh = tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    ok = (t[:, None] < T - 1) & (d[None, :] < D)
    base = k_ptr + b * skb + h * skh + d[None, :] * skd
    left = tl.load(base + t[:, None] * skt, mask=ok, other=0.0).to(tl.float32)
    right = tl.load(base + (t[:, None] + 1) * skt, mask=ok, other=0.0).to(tl.float32)
    norms = tl.maximum(tl.sqrt(tl.sum(left * left, 1)), 1e-12) * tl.maximum(tl.sqrt(tl.sum(right * right, 1)), 1e-12)
    tl.store(out_ptr + pid_bh * (T - 1) + t, tl.sum(left * right, 1) / norms, mask=t < T - 1)


@triton.jit
def _anchor_joins(
    k_ptr, merge_ptr, joins_ptr, skb, skh, skt, skd, H, T, D, epsilon, BLOCK_D: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    b, h = pid_bh // H, pid_bh % H
    d = tl.arange(0, BLOCK_D)
    base = k_ptr + b * skb + h * skh + d * skd
    anchor = tl.load(base + (T - 1) * skt, mask=d < D, other=0.0).to(tl.float32)
    anchor = anchor / tl.maximum(tl.sqrt(tl.sum(anchor * anchor, 0)), 1e-12)
    right_mergeable = tl.load(merge_ptr + pid_bh * T + T - 1) != 0
    for step in range(0, T - 1):
        t = T - 2 - step
        unit = tl.load(base + t * skt, mask=d < D, other=0.0).to(tl.float32)
        unit = unit / tl.maximum(tl.sqrt(tl.sum(unit * unit, 0)), 1e-12)
        mergeable = tl.load(merge_ptr + pid_bh * T + t) != 0
        join = mergeable & right_mergeable & (tl.sum(anchor * unit, 0) > epsilon)
        tl.store(joins_ptr + pid_bh * (T - 1) + t, join.to(tl.int8))
        anchor = tl.where(join, anchor, unit)
        right_mergeable = mergeable


def adjacent_cosine(keys: Tensor) -> Tensor:
    """Triton ``similarity.adjacent_cosine``: keys (B, H, T, D) -> (B, H, T-1) float32."""
    B, H, T, D = keys.shape
    out = torch.empty(B, H, max(T - 1, 0), dtype=torch.float32, device=keys.device)
    if T > 1:
        _adjacent_cosine[(triton.cdiv(T - 1, BLOCK_T), B * H)](
            keys, out, *keys.stride(), H, T, D, BLOCK_T=BLOCK_T, BLOCK_D=max(16, triton.next_power_of_2(D)),
        )
    return out


def anchor_runs(keys: Tensor, mergeable: Tensor, lengths: Tensor, epsilon: float) -> Tensor:
    """Triton ``similarity.anchor_runs``: run ids (B, H, T) long, -1 on padding."""
    B, H, T, D = keys.shape
    joins = torch.zeros(B, H, max(T - 1, 0), dtype=torch.int8, device=keys.device)
    if T > 1:
        _anchor_joins[(B * H,)](
            keys, mergeable.to(torch.int8).contiguous(), joins, *keys.stride(), H, T, D, float(epsilon),
            BLOCK_D=max(16, triton.next_power_of_2(D)),
        )
    return run_ids(joins.bool(), lengths)
