"""Triton twin of ``partner_merge.merge_into_partners`` (same signature, same merge): two launches per step.

``_groups``, one program per row, walks the row twice: first the survivors' ranks (a running cumulative sum),
then every real slot's group (its own rank, or its partner's) and the groups' degrees. Degrees are whole
numbers, so their float32 sums are exact in any order. ``_merge``, one program per (slot tile, row), weights
every slot by degree / group degree and adds it into its group's float32 key and value with atomics, and writes
the survivor's position, degree and slot. Additions arrive in no fixed order on a GPU, so a group of three or
more slots may differ from the reference's slot-order sum in the last float32 bit (as ``triton_merge``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_SCAN = 4096  # one program walks a whole row: few, wide tiles
BLOCK_T = 32


@triton.jit
def _groups(absorbed_ptr, partner_ptr, merged_ptr, lengths_ptr, group_ptr, degree_ptr, T, G,
            BLOCK: tl.constexpr):
    row = tl.program_id(0)
    length = tl.load(lengths_ptr + row)
    base = row.to(tl.int64) * T
    carry = 0
    for start in range(0, T, BLOCK):
        slot = start + tl.arange(0, BLOCK)
        valid = slot < length
        survivor = valid & (tl.load(absorbed_ptr + base + slot, mask=valid, other=1) == 0)
        rank = carry + tl.cumsum(survivor.to(tl.int32), 0) - 1
        tl.store(group_ptr + base + slot, rank.to(tl.int64), mask=survivor)
        carry += tl.sum(survivor.to(tl.int32), 0)
    tl.debug_barrier()  # every survivor's rank is stored before any partner's is read
    for start in range(0, T, BLOCK):
        slot = start + tl.arange(0, BLOCK)
        valid = slot < length
        absorbed = valid & (tl.load(absorbed_ptr + base + slot, mask=valid, other=0) != 0)
        partner = tl.load(partner_ptr + base + slot, mask=absorbed, other=0)
        own = tl.load(group_ptr + base + slot, mask=valid & ~absorbed, other=-1)
        theirs = tl.load(group_ptr + base + partner, mask=absorbed, other=-1)
        group = tl.where(absorbed, theirs, own)
        group = tl.where(valid & (group < G), group, -1)  # a survivor past G cannot be stored: leave it out
        tl.store(group_ptr + base + slot, group, mask=slot < T)
        degree = tl.load(merged_ptr + base + slot, mask=group >= 0, other=0.0).to(tl.float32) + 1.0
        tl.atomic_add(degree_ptr + row.to(tl.int64) * G + group, degree, mask=group >= 0, sem="relaxed")


@triton.jit
def _merge(
    k_ptr, v_ptr, pos_ptr, merged_ptr, absorbed_ptr, group_ptr, degree_ptr,
    out_k_ptr, out_v_ptr, out_pos_ptr, out_merged_ptr, out_source_ptr,
    skb, skh, skt, skd, svb, svh, svt, svd, H, T, D, G, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(1)
    b, h = row // H, row % H
    slot = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    base = row.to(tl.int64) * T
    group = tl.load(group_ptr + base + slot, mask=slot < T, other=-1)
    real = group >= 0
    out_slot = row.to(tl.int64) * G + group
    cluster = tl.load(degree_ptr + out_slot, mask=real, other=1.0)
    degree = tl.load(merged_ptr + base + slot, mask=real, other=0.0).to(tl.float32) + 1.0
    weight = tl.math.div_rn(degree, tl.maximum(cluster, 1.0))[:, None]
    d = tl.arange(0, BLOCK_D)
    both = real[:, None] & (d[None, :] < D)
    k = tl.load(k_ptr + b * skb + h * skh + slot[:, None] * skt + d[None, :] * skd, mask=both, other=0.0)
    v = tl.load(v_ptr + b * svb + h * svh + slot[:, None] * svt + d[None, :] * svd, mask=both, other=0.0)
    out = out_slot[:, None] * D + d[None, :]
    tl.atomic_add(out_k_ptr + out, k.to(tl.float32) * weight, mask=both, sem="relaxed")
    tl.atomic_add(out_v_ptr + out, v.to(tl.float32) * weight, mask=both, sem="relaxed")
    survivor = real & (tl.load(absorbed_ptr + base + slot, mask=real, other=1) == 0)
    tl.store(out_pos_ptr + out_slot, tl.load(pos_ptr + base + slot, mask=survivor), mask=survivor)
    tl.store(out_merged_ptr + out_slot, cluster - 1.0, mask=survivor)
    tl.store(out_source_ptr + out_slot, slot.to(tl.int64), mask=survivor)


def merge_into_partners(
    keys: Tensor, values: Tensor, positions: Tensor, merged: Tensor, lengths: Tensor, absorbed: Tensor,
    partner: Tensor, capacity: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Triton ``partner_merge.merge_into_partners``: keys/values (B, H, T, D), the rest (B, H, T) ->
    keys, values (B, H, G, D), positions, merged, source (B, H, G), G = ``capacity``."""
    B, H, T, D = keys.shape
    G = capacity
    positions, merged, absorbed, partner = (x.contiguous() for x in (positions, merged, absorbed, partner))
    group = torch.empty(B, H, T, dtype=torch.long, device=keys.device)
    degree = torch.zeros(B, H, G, dtype=torch.float32, device=keys.device)
    _groups[(B * H,)](absorbed, partner, merged, lengths.contiguous(), group, degree, T, G, BLOCK=BLOCK_SCAN,
                          num_warps=8)
    out_k = torch.zeros(B, H, G, D, dtype=torch.float32, device=keys.device)
    out_v = torch.zeros_like(out_k)
    out_pos = torch.full((B, H, G), -1, dtype=positions.dtype, device=keys.device)
    out_merged = torch.zeros(B, H, G, dtype=merged.dtype, device=keys.device)
    source = torch.zeros(B, H, G, dtype=torch.long, device=keys.device)
    _merge[(triton.cdiv(T, BLOCK_T), B * H)](
        keys, values, positions, merged, absorbed, group, degree, out_k, out_v, out_pos, out_merged, source,
        *keys.stride(), *values.stride(), H, T, D, G, BLOCK_T=BLOCK_T, BLOCK_D=max(16, triton.next_power_of_2(D)),
    )
    return out_k.to(keys.dtype), out_v.to(values.dtype), out_pos, out_merged, source
