"""Triton twins of ``merge.scatter_merge`` and ``merge.group_sum``: same signatures, float32 accumulation.

One program per (slot tile, b, h): it weights its slots and adds them into their groups with float32
atomics. Targets are arbitrary (Chelsea's matching is not contiguous), so no segment order is assumed;
the order of the additions varies on a GPU, hence results equal the reference within float32 rounding. The
atomics are relaxed: nothing reads the sums before the launch ends (``triton_lut_attention._member_weights``).
Inputs are cast to float32 after loading (Triton's CPU interpreter cannot compute on bfloat16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_T = 64


@triton.jit
def _scatter_merge(
    x_ptr, tgt_ptr, w_ptr, out_ptr, sxb, sxh, sxt, sxd, H, T, D, G,
    HAS_X: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_bh = tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    slots = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tgt = tl.load(tgt_ptr + pid_bh * T + slots, mask=slots < T, other=-1)
    keep = (slots < T) & (tgt >= 0)
    w = tl.load(w_ptr + pid_bh * T + slots, mask=keep, other=0.0).to(tl.float32)
    if HAS_X:
        d = tl.arange(0, BLOCK_D)
        both = keep[:, None] & (d[None, :] < D)
        x = tl.load(x_ptr + b * sxb + h * sxh + slots[:, None] * sxt + d[None, :] * sxd, mask=both, other=0.0)
        tl.atomic_add(out_ptr + (pid_bh * G + tgt[:, None]) * D + d[None, :], x.to(tl.float32) * w[:, None],
                      mask=both, sem="relaxed")
    else:
        tl.atomic_add(out_ptr + pid_bh * G + tgt, w, mask=keep, sem="relaxed")


def scatter_merge(x: Tensor, target: Tensor, weight: Tensor, num_groups: int) -> Tensor:
    """Triton ``merge.scatter_merge``: x (B, H, T, D), target/weight (B, H, T) -> (B, H, num_groups, D)."""
    B, H, T, D = x.shape
    out = torch.zeros(B, H, num_groups, D, dtype=torch.float32, device=x.device)
    _scatter_merge[(triton.cdiv(T, BLOCK_T), B * H)](
        x, target.contiguous(), weight.contiguous(), out, *x.stride(), H, T, D, num_groups,
        HAS_X=True, BLOCK_T=BLOCK_T, BLOCK_D=max(16, triton.next_power_of_2(D)),
    )
    return out.to(x.dtype)


def group_sum(weight: Tensor, target: Tensor, num_groups: int) -> Tensor:
    """Triton ``merge.group_sum``: weight/target (B, H, T) -> (B, H, num_groups) float32."""
    B, H, T = weight.shape
    out = torch.zeros(B, H, num_groups, dtype=torch.float32, device=weight.device)
    _scatter_merge[(triton.cdiv(T, BLOCK_T), B * H)](
        weight, target.contiguous(), weight.contiguous(), out, 0, 0, 0, 0, H, T, 1, num_groups,
        HAS_X=False, BLOCK_T=BLOCK_T, BLOCK_D=16,
    )
    return out
