"""Triton twin of ``append.append_slots``: one program per row (b, h) copies the row's q new keys, values and
positions into slots [length, length + q) in tiles of tokens, zeroes the states there and stores the new
length (each program owns its row, so no other program reads the length it writes)."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from kvbench.kernels.triton_slots import block_size

BLOCK_Q = 16  # new tokens per tile


@triton.jit
def _append(
    nk_ptr, nv_ptr, np_ptr, len_ptr, k_ptr, v_ptr, pos_ptr, state_ptr,
    slb, slh, snkb, snkh, snkq, snkd, snvb, snvh, snvq, snvd, snpb, snpq,
    skb, skh, skt, skd, svb, svh, svt, svd, spb, sph, spt, sss, ssb, ssh, sst,
    H, q, D, DV, S,
    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0)
    b, h = row // H, row % H
    length = tl.load(len_ptr + b * slb + h * slh)
    d, dv, s = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_S)
    for j0 in range(0, q, BLOCK_Q):
        j = j0 + tl.arange(0, BLOCK_Q)
        new = j < q
        slot = length + j
        key = tl.load(nk_ptr + b * snkb + h * snkh + j[:, None] * snkq + d[None, :] * snkd,
                      mask=new[:, None] & (d[None, :] < D))
        tl.store(k_ptr + b * skb + h * skh + slot[:, None] * skt + d[None, :] * skd,
                 key.to(k_ptr.dtype.element_ty), mask=new[:, None] & (d[None, :] < D))
        value = tl.load(nv_ptr + b * snvb + h * snvh + j[:, None] * snvq + dv[None, :] * snvd,
                        mask=new[:, None] & (dv[None, :] < DV))
        tl.store(v_ptr + b * svb + h * svh + slot[:, None] * svt + dv[None, :] * svd,
                 value.to(v_ptr.dtype.element_ty), mask=new[:, None] & (dv[None, :] < DV))
        position = tl.load(np_ptr + b * snpb + j * snpq, mask=new)
        tl.store(pos_ptr + b * spb + h * sph + slot * spt, position, mask=new)
        tl.store(state_ptr + s[:, None] * sss + b * ssb + h * ssh + slot[None, :] * sst,
                 tl.zeros((BLOCK_S, BLOCK_Q), tl.float32), mask=(s[:, None] < S) & new[None, :])
    tl.store(len_ptr + b * slb + h * slh, length + q)


def append_slots(new_keys: Tensor, new_values: Tensor, new_positions: Tensor, lengths: Tensor, keys: Tensor,
                 values: Tensor, positions: Tensor, state: Tensor) -> None:
    """Triton ``append.append_slots``."""
    B, H, q, D = new_keys.shape
    DV, S = new_values.shape[-1], state.shape[0]
    state_strides = state.stride() if S else (0, 0, 0, 0)
    _append[(B * H,)](
        new_keys, new_values, new_positions, lengths, keys, values, positions, state, *lengths.stride(),
        *new_keys.stride(), *new_values.stride(), *new_positions.stride(),
        *keys.stride(), *values.stride(), *positions.stride(), *state_strides,
        H, q, D, DV, S,
        BLOCK_Q=BLOCK_Q, BLOCK_D=triton.next_power_of_2(D), BLOCK_DV=triton.next_power_of_2(DV),
        BLOCK_S=block_size(S),
    )
