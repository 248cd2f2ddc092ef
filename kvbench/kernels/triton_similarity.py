"""Triton twins of ``similarity.adjacent_cosine``, ``similarity.anchor_runs`` and ``similarity.best_match_cosine``
(same signatures).

- ``_adjacent_cosine``: one program per (slot tile, b, h): loads slots t and t+1, one pass, O(T D).
- ``_anchor_joins``: one program per row (b, h) walks the row from the right keeping the anchor's unit key
  in registers: the reference's T-step Python loop of small torch ops becomes one sequential loop per row.
  The run numbering that follows is ``similarity.run_ids`` itself (a cumulative sum), not re-implemented.
- ``_best_match``: one program per (source tile, b, h) loops over the row's targets (both lists compacted by
  ``true_first``, read through their slot indices) and keeps each source's running argmax of the cosine, so
  the |sources| x |targets| block is never stored; the dot products multiply the keys in their own dtype
  (exact products, float32 sums; float32 keys at full precision), then scale by the inverse norms.
Normalisation matches ``similarity.unit_keys`` (x / max(|x|, 1e-12)); the first two kernels cast inputs to
float32 on load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvbench.kernels.select import true_first
from kvbench.kernels.similarity import run_ids
from kvbench.kernels.triton_attention import INTERPRETED

BLOCK_T = 64
BEST_MATCH_TILES = (64, 64, 4, 2)  # (sources per program, targets per step, warps, stages)


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


@triton.jit
def _best_match(
    k_ptr, inv_ptr, src_ptr, tgt_ptr, nsrc_ptr, ntgt_ptr, sim_ptr, match_ptr, skb, skh, skt, skd, H, T, D,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_bh = tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    n_src = tl.load(nsrc_ptr + pid_bh)
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    row_ok = rows < n_src
    n_tgt = tl.where(tl.program_id(0) * BLOCK_S < n_src, tl.load(ntgt_ptr + pid_bh), 0)  # idle tiles skip
    d = tl.arange(0, BLOCK_D)
    base = k_ptr + b * skb + h * skh + d[None, :] * skd
    src = tl.load(src_ptr + pid_bh * T + rows, mask=row_ok, other=0)
    q = tl.load(base + src[:, None] * skt, mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_inv = tl.load(inv_ptr + pid_bh * T + src, mask=row_ok, other=0.0)
    best = tl.full((BLOCK_S,), float("-inf"), tl.float32)
    arg = tl.full((BLOCK_S,), -1, tl.int32)
    for start in range(0, n_tgt, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        col_ok = cols < n_tgt
        tgt = tl.load(tgt_ptr + pid_bh * T + cols, mask=col_ok, other=0)
        k = tl.load(base + tgt[:, None] * skt, mask=col_ok[:, None] & (d[None, :] < D), other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        k_inv = tl.load(inv_ptr + pid_bh * T + tgt, mask=col_ok, other=0.0)
        sim = tl.dot(q, tl.trans(k), input_precision=PRECISION) * q_inv[:, None] * k_inv[None, :]
        sim = tl.where(col_ok[None, :], sim, float("-inf"))
        tile_best = tl.max(sim, 1)
        tile_arg = tl.argmax(sim, 1, tie_break_left=True)
        better = tile_best > best  # strictly: an earlier tile keeps a tie (the earliest target wins)
        arg = tl.where(better, start + tile_arg, arg)
        best = tl.where(better, tile_best, best)
    found = row_ok & (arg >= 0)
    slot = tl.load(tgt_ptr + pid_bh * T + arg, mask=found, other=-1)
    tl.store(sim_ptr + pid_bh * T + src, best, mask=found)
    tl.store(match_ptr + pid_bh * T + src, slot, mask=found)


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


def best_match_cosine(keys: Tensor, sources: Tensor, targets: Tensor, chunk: int = 1024) -> tuple[Tensor, Tensor]:
    """Triton ``similarity.best_match_cosine`` (``chunk`` is the reference's memory knob): (similarity, match),
    both (B, H, T). No host synchronisation: idle source tiles of short rows return at once."""
    B, H, T, D = keys.shape
    similarity = torch.full((B, H, T), -float("inf"), dtype=torch.float32, device=keys.device)
    match = torch.full((B, H, T), -1, dtype=torch.long, device=keys.device)
    if T == 0:
        return similarity, match
    inverse_norm = 1.0 / keys.float().norm(dim=-1).clamp(min=1e-12)
    block_s, block_c, warps, stages = BEST_MATCH_TILES
    _best_match[(triton.cdiv(T, block_s), B * H)](
        keys, inverse_norm, true_first(sources), true_first(targets), sources.sum(-1, dtype=torch.int32),
        targets.sum(-1, dtype=torch.int32), similarity, match, *keys.stride(), H, T, D,
        BLOCK_S=block_s, BLOCK_C=block_c, BLOCK_D=max(16, triton.next_power_of_2(D)),
        PRECISION="ieee" if keys.dtype == torch.float32 or INTERPRETED else "tf32", UPCAST=INTERPRETED,
        num_warps=warps, num_stages=stages,
    )
    return similarity, match
