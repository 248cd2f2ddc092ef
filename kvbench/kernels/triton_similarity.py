"""Triton twins of ``similarity.adjacent_cosine``, ``similarity.anchor_runs`` and ``similarity.best_match_cosine``
(same signatures).

- ``_adjacent_cosine``: one program per (slot tile, b, h): loads slots t and t+1, one pass, O(T D).
- ``_anchor_joins``: one program per row (b, h) walks the row from the right keeping the anchor's unit key
  in registers: the reference's T-step Python loop of small torch ops becomes one sequential loop per row.
  The run numbering that follows is ``similarity.run_ids`` itself (a cumulative sum), not re-implemented.
- ``_best_match`` (D2O's nearest kept slot, EMS's most redundant centre): one program per (source tile, b, h)
  loops over the row's targets (slot lists, read through their indices) and keeps each source's running
  argmax of the cosine (EMS: of R, the clamped cosines of keys and values multiplied), so the |sources| x
  |targets| block is never stored; the dot products multiply the inputs in their own dtype (exact products,
  float32 sums; float32 inputs at full precision), then scale by the inverse norms.
Normalisation matches ``similarity.unit_keys`` (x / max(|x|, 1e-12)); the first two kernels cast inputs to
float32 on load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvbench.kernels.redundancy import compared
from kvbench.kernels.select import true_first
from kvbench.kernels.similarity import run_ids
from kvbench.kernels.triton_attention import INTERPRETED, _precision

BLOCK_T = 64
# (sources per program, targets per step, warps, stages). At 32k on an H200 (bench_prefill's layer), 128 targets a
# step took EMS's redundancy search 2.56 -> 2.23 ms a layer and D2O's nearest-kept search 1.79 -> 1.46 (wider source
# tiles, 128 x 64, were slower: 3.7-4.0 ms for EMS; results/gpu/2026-11-30/logs/s22_call1_best_match_tiles.txt). Ties
# go to the earliest target whatever the tiles; the interpreter keeps 64 so that the tests cross target tiles.
BEST_MATCH_TILES = (64, 64, 4, 2) if INTERPRETED else (64, 128, 4, 2)


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
    a_ptr, b_ptr, inv_a_ptr, inv_b_ptr, src_ptr, nsrc_ptr, tgt_ptr, ntgt_ptr, best_ptr, match_ptr,
    sab, sah, sat, sad, sbb, sbh, sbt, sbd, H, T, M, C, DA, DB,
    TWO: tl.constexpr, CLAMP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr, PRECISION_A: tl.constexpr, PRECISION_B: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_bh = tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    n_src = tl.load(nsrc_ptr + pid_bh)
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    row_ok = rows < n_src
    n_tgt = tl.where(tl.program_id(0) * BLOCK_S < n_src, tl.load(ntgt_ptr + pid_bh), 0)  # idle tiles skip
    da, db = tl.arange(0, BLOCK_DA), tl.arange(0, BLOCK_DB)
    a_base = a_ptr + b * sab + h * sah + da[None, :] * sad
    b_base = b_ptr + b * sbb + h * sbh + db[None, :] * sbd
    src = tl.load(src_ptr + pid_bh * M + rows, mask=row_ok, other=0)
    qa = tl.load(a_base + src[:, None] * sat, mask=row_ok[:, None] & (da[None, :] < DA), other=0.0)
    qa_inv = tl.load(inv_a_ptr + pid_bh * T + src, mask=row_ok, other=0.0)
    if UPCAST:
        qa = qa.to(tl.float32)
    if TWO:
        qb = tl.load(b_base + src[:, None] * sbt, mask=row_ok[:, None] & (db[None, :] < DB), other=0.0)
        qb_inv = tl.load(inv_b_ptr + pid_bh * T + src, mask=row_ok, other=0.0)
        if UPCAST:
            qb = qb.to(tl.float32)
    best = tl.full((BLOCK_S,), float("-inf"), tl.float32)
    arg = tl.full((BLOCK_S,), -1, tl.int32)
    for start in range(0, n_tgt, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        col_ok = cols < n_tgt
        tgt = tl.load(tgt_ptr + pid_bh * C + cols, mask=col_ok, other=0)
        ka = tl.load(a_base + tgt[:, None] * sat, mask=col_ok[:, None] & (da[None, :] < DA), other=0.0)
        if UPCAST:
            ka = ka.to(tl.float32)
        ka_inv = tl.load(inv_a_ptr + pid_bh * T + tgt, mask=col_ok, other=0.0)
        sim = tl.dot(qa, tl.trans(ka), input_precision=PRECISION_A) * qa_inv[:, None] * ka_inv[None, :]
        if CLAMP:
            sim = tl.maximum(sim, 0.0)
        if TWO:
            kb = tl.load(b_base + tgt[:, None] * sbt, mask=col_ok[:, None] & (db[None, :] < DB), other=0.0)
            if UPCAST:
                kb = kb.to(tl.float32)
            kb_inv = tl.load(inv_b_ptr + pid_bh * T + tgt, mask=col_ok, other=0.0)
            sim_b = tl.dot(qb, tl.trans(kb), input_precision=PRECISION_B) * qb_inv[:, None] * kb_inv[None, :]
            sim = sim * tl.maximum(sim_b, 0.0)
        sim = tl.where(col_ok[None, :], sim, float("-inf"))
        tile_best = tl.max(sim, 1)
        tile_arg = tl.argmax(sim, 1, tie_break_left=True)
        better = tile_best > best  # strictly: an earlier tile keeps a tie (the earliest target wins)
        arg = tl.where(better, start + tile_arg, arg)
        best = tl.where(better, tile_best, best)
    found = row_ok & (arg >= 0)
    slot = tl.load(tgt_ptr + pid_bh * C + arg, mask=found, other=-1)
    tl.store(best_ptr + pid_bh * M + rows, best, mask=row_ok)
    tl.store(match_ptr + pid_bh * M + rows, tl.where(found, slot, -1), mask=row_ok)


def _best_matches(first: Tensor, second: Tensor | None, sources: Tensor, source_count: Tensor, targets: Tensor,
                  target_count: Tensor, clamp: bool) -> tuple[Tensor, Tensor]:
    """Launch ``_best_match``: features (B, H, T, D) (``second``: multiplied in, clamped at 0), slot lists
    sources (B, H, M) and targets (B, H, C) with their real counts (B, H) -> (best, match), both (B, H, M);
    -inf / -1 past a row's sources and for rows without targets."""
    B, H, M = sources.shape
    best = torch.full((B, H, M), -float("inf"), dtype=torch.float32, device=first.device)
    match = torch.full((B, H, M), -1, dtype=torch.long, device=first.device)
    if M == 0 or targets.shape[-1] == 0:
        return best, match
    two = second is not None
    second = first if second is None else second
    inverse = [1.0 / x.float().norm(dim=-1).clamp(min=1e-12) for x in ((first, second) if two else (first,))]
    block_s, block_c, warps, stages = BEST_MATCH_TILES
    _best_match[(triton.cdiv(M, block_s), B * H)](
        first, second, inverse[0], inverse[-1], sources.contiguous(), source_count.to(torch.int32).contiguous(),
        targets.contiguous(), target_count.to(torch.int32).contiguous(), best, match,
        *first.stride(), *second.stride(), H, first.shape[2], M, targets.shape[-1], first.shape[-1],
        second.shape[-1], TWO=two, CLAMP=clamp, BLOCK_S=block_s, BLOCK_C=block_c,
        BLOCK_DA=max(16, triton.next_power_of_2(first.shape[-1])),
        BLOCK_DB=max(16, triton.next_power_of_2(second.shape[-1])), PRECISION_A=_precision(first),
        PRECISION_B=_precision(second), UPCAST=INTERPRETED, num_warps=warps, num_stages=stages,
    )
    return best, match


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


def best_match_cosine(keys: Tensor, sources: Tensor, targets: Tensor, chunk: int = 512) -> tuple[Tensor, Tensor]:
    """Triton ``similarity.best_match_cosine`` (``chunk`` is the reference's memory knob): (similarity, match),
    both (B, H, T). No host synchronisation: idle source tiles of short rows return at once."""
    source_slots = true_first(sources)
    best, match = _best_matches(keys, None, source_slots, sources.sum(-1), true_first(targets), targets.sum(-1),
                                clamp=False)
    return (torch.empty_like(best).scatter_(2, source_slots, best),
            torch.empty_like(match).scatter_(2, source_slots, match))


def most_redundant(raw_keys: Tensor, values: Tensor, sources: Tensor, source_count: Tensor, targets: Tensor,
                   target_count: Tensor, similarity: str, chunk: int = 512) -> tuple[Tensor, Tensor]:
    """Triton ``redundancy.most_redundant`` (``chunk`` is the reference's memory knob): (best, match) (B, H, M)."""
    features = compared(raw_keys, values, similarity)
    return _best_matches(features[0], features[1] if len(features) > 1 else None, sources, source_count, targets,
                         target_count, clamp=True)
