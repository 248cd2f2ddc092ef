"""Triton twin of CaM's prompt merge shares (``methods.cam.CaM._shares``: ``_merge_probabilities`` then
``_merge_mask``, divided by n): same arguments, bit-identical results.

One program per (slot tile, b, h): every slot adds the scores of its next n real slots in the order the
reference adds them (offset 1 first), divides with IEEE rounding (``div_rn``; Triton's plain ``/`` on float32
is approximate), and draws its Bernoulli mask from the same counter-based hash (``triton_cam_step.uniform_draw``, the
multipliers below 2^31 so no product overflows). A draw is exact, so a mask never differs from the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvbench.kernels.triton_cam_step import merge_probability, uniform_draw

BLOCK_T = 256


@triton.jit
def _merge_shares(
    att_ptr, len_ptr, pos_ptr, evicted_ptr, newest_ptr, out_ptr, H, T, key,
    N: tl.constexpr, DETERMINISTIC: tl.constexpr, BLOCK_T: tl.constexpr,
):
    pid_bh = tl.program_id(1)
    slots = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_row = slots < T
    length = tl.load(len_ptr + pid_bh)
    base = pid_bh * T
    total = tl.zeros((BLOCK_T,), tl.float32)
    for offset in tl.static_range(1, N + 1):
        total += tl.load(att_ptr + base + slots + offset, mask=slots + offset < length, other=0.0)
    count = tl.minimum(tl.maximum(length - 1 - slots, 0), N)
    score = tl.load(att_ptr + base + slots, mask=in_row, other=0.0)
    prob = merge_probability(score, total, count)
    evicted = tl.load(evicted_ptr + base + slots, mask=in_row, other=0) != 0
    prob = tl.where(evicted, prob, 0.0)
    if DETERMINISTIC:
        merged = prob
    else:
        head = tl.zeros((BLOCK_T,), tl.int64) + pid_bh % H
        position = tl.load(pos_ptr + base + slots, mask=in_row, other=0).to(tl.int64)
        newest = tl.load(newest_ptr + pid_bh).to(tl.int64)
        merged = (uniform_draw(key, head, position, newest) < prob).to(tl.float32)
    tl.store(out_ptr + base + slots, tl.math.div_rn(merged, tl.full((BLOCK_T,), N, tl.float32)), mask=in_row)


def merge_shares(attention: Tensor, lengths: Tensor, positions: Tensor, evicted: Tensor, newest: Tensor, n: int,
                 key: int | None) -> Tensor:
    """m_e / n of every slot (B, H, T) float32, 0 on slots that stay: attention/positions/evicted (B, H, T),
    lengths and the rows' newest positions (B, H), ``key`` the layer's hash key (None: deterministic, m = p)."""
    B, H, T = attention.shape
    out = torch.empty(B, H, T, dtype=torch.float32, device=attention.device)
    if T:
        _merge_shares[(triton.cdiv(T, BLOCK_T), B * H)](
            attention.float().contiguous(), lengths.contiguous(), positions.contiguous(),
            evicted.to(torch.int8).contiguous(), newest.contiguous(), out, H, T, 0 if key is None else key,
            N=n, DETERMINISTIC=key is None, BLOCK_T=BLOCK_T,
        )
    return out
