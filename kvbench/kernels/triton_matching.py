"""Triton twin of ``matching.chunked_soft_matching`` (same signature, same edges).

One program per (A tile of one chunk, b, h): it loads its A slots (even offsets of the chunk), normalises
them, and walks the chunk's B slots (odd offsets) tile by tile keeping each A slot's best cosine and the
earliest B slot reaching it (cosines from a three-pass TF32 product, ``DOT_PRECISION``). Memory per program is two tiles, whatever the chunk size (no chunking = one
chunk of the whole region). Chunk geometry (size, count) is the reference's, computed on the host
(from ``longest`` when the caller knows it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_A = 32
BLOCK_B = 32
# Three TF32 tensor-core products that sum to float32 accuracy (about 2^-22 relative, against 2^-24 for the
# FMA product "ieee" gives): the FMA product made the matching 2.4 ms of a 32k layer's 9.3 ms compression on
# an H100. Either differs from the torch reference's float32 matmul only in rounding, so an A slot's best B
# slot can differ only where two cosines agree to about 1e-7.
DOT_PRECISION = tl.constexpr("tf32x3")


@triton.jit
def _unit_rows(k_ptr, slot, ok, d, D, skt, skd):
    x = tl.load(k_ptr + slot[:, None] * skt + d[None, :] * skd, mask=ok[:, None] & (d[None, :] < D), other=0.0)
    x = x.to(tl.float32)
    return x / tl.maximum(tl.sqrt(tl.sum(x * x, 1)), 1e-12)[:, None]


@triton.jit
def _csm(
    k_ptr, start_ptr, count_ptr, partner_ptr, sim_ptr, skb, skh, skt, skd, H, T, D, size, a_tiles,
    BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_bh = tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    chunk, a_tile = tl.program_id(0) // a_tiles, tl.program_id(0) % a_tiles
    start, count = tl.load(start_ptr + pid_bh), tl.load(count_ptr + pid_bh)
    base = k_ptr + b * skb + h * skh
    d = tl.arange(0, BLOCK_D)
    a_off = chunk * size + 2 * (a_tile * BLOCK_A + tl.arange(0, BLOCK_A))
    a_ok = (a_off < count) & (a_off < (chunk + 1) * size)
    a = _unit_rows(base, start + a_off, a_ok, d, D, skt, skd)
    best = tl.full((BLOCK_A,), float("-inf"), tl.float32)
    arg = tl.zeros((BLOCK_A,), tl.int32)
    for b_start in range(0, size // 2, BLOCK_B):
        j = b_start + tl.arange(0, BLOCK_B)
        b_off = chunk * size + 2 * j + 1
        b_ok = (b_off < count) & (j < size // 2)
        bk = _unit_rows(base, start + b_off, b_ok, d, D, skt, skd)
        sim = tl.dot(a, tl.trans(bk), input_precision=DOT_PRECISION)
        sim = tl.where(b_ok[None, :], sim, float("-inf"))
        tile_best = tl.max(sim, 1)
        tile_arg = tl.min(tl.where(sim == tile_best[:, None], j[None, :], 2147483647), 1)  # earliest on ties
        better = tile_best > best  # strict: an earlier tile keeps its tie
        arg = tl.where(better, tile_arg, arg)
        best = tl.where(better, tile_best, best)
    edge = a_ok & (best > float("-inf"))
    slot = start + a_off
    tl.store(partner_ptr + pid_bh * T + slot, (start + chunk * size + 2 * arg + 1).to(tl.int64), mask=edge)
    tl.store(sim_ptr + pid_bh * T + slot, best, mask=edge)


def chunked_soft_matching(
    keys: Tensor, start: Tensor, count: Tensor, chunk_size: int | None, longest: int | None = None
) -> tuple[Tensor, Tensor]:
    """Triton ``matching.chunked_soft_matching``: (partner, similarity), both (B, H, T)."""
    B, H, T, D = keys.shape
    partner = torch.full((B, H, T), -1, dtype=torch.long, device=keys.device)
    similarity = torch.full((B, H, T), -float("inf"), device=keys.device)
    M = longest if longest is not None else int(count.max()) if count.numel() else 0
    if M < 2:
        return partner, similarity
    size = M if chunk_size is None else min(chunk_size, M)
    a_tiles = triton.cdiv((size + 1) // 2, BLOCK_A)
    _csm[(triton.cdiv(M, size) * a_tiles, B * H)](
        keys, start.contiguous(), count.contiguous(), partner, similarity, *keys.stride(), H, T, D, size, a_tiles,
        BLOCK_A=BLOCK_A, BLOCK_B=BLOCK_B, BLOCK_D=max(16, triton.next_power_of_2(D)),
    )
    return partner, similarity
