"""Triton twin of ``compact.compact``: one program per (kept-slot tile, b, h) copies whole rows of D into an
output pre-filled with ``fill`` (so padding needs no dtype-specific constant inside the kernel)."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

BLOCK_K = 64


@triton.jit
def _compact(
    x_ptr, idx_ptr, len_ptr, out_ptr, sxb, sxh, sxt, sxd, H, K, D,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_bh = tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    d = tl.arange(0, BLOCK_D)
    length = tl.load(len_ptr + pid_bh)
    kept = k < length
    src = tl.load(idx_ptr + pid_bh * K + k, mask=kept, other=0)
    both = kept[:, None] & (d[None, :] < D)
    # Loaded without conversion: a plain copy, so the interpreter's raw bfloat16 bits pass through intact.
    x = tl.load(x_ptr + b * sxb + h * sxh + src[:, None] * sxt + d[None, :] * sxd, mask=both)
    tl.store(out_ptr + (pid_bh * K + k[:, None]) * D + d[None, :], x, mask=both)


def compact(x: Tensor, index: Tensor, lengths: Tensor, fill: float = 0) -> Tensor:
    """Triton ``compact.compact``: x (B, H, T, D), index (B, H, K), lengths (B, H) -> (B, H, K, D)."""
    B, H, _, D = x.shape
    K = index.shape[-1]
    out = x.new_full((B, H, K, D), fill)
    if out.numel():
        _compact[(triton.cdiv(K, BLOCK_K), B * H)](
            x, index.contiguous(), lengths.contiguous(), out, *x.stride(), H, K, D,
            BLOCK_K=BLOCK_K, BLOCK_D=max(16, triton.next_power_of_2(D)),
        )
    return out
