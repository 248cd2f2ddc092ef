"""Merge of one clustering step into survivor slots: every absorbed slot joins its partner (Chelsea §5.2, one
CSM step). Torch reference; ``triton_partner_merge`` holds the kernels of the same signature (see ``dispatch``).

A step's groups are stars: a surviving slot plus the absorbed slots whose partner it is. Survivors keep their
slot order and become the degree-weighted centroid of their group, k = sum n_i k_i / sum n_i (v likewise),
with degree sum n_i; positions and any other state follow the survivor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvbench.kernels.dispatch import use_triton
from kvbench.kernels.merge import group_sum, scatter_merge


def merge_into_partners(
    keys: Tensor, values: Tensor, positions: Tensor, merged: Tensor, lengths: Tensor, absorbed: Tensor,
    partner: Tensor, capacity: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One step's merge, re-allocated at ``capacity`` slots.

    keys, values: (B, H, T, D); positions: (B, H, T) long; merged: (B, H, T) float state, tokens merged into
    each slot besides its own (degree - 1); lengths: (B, H) long; absorbed: (B, H, T) bool, the real slots
    that leave (never a partner); partner: (B, H, T) long, the surviving slot each absorbed slot joins.
    ``capacity`` is the longest row of survivors (the caller knows it on the host: no read-back here).

    Returns (keys, values, positions, merged, source), G = ``capacity`` slots per row, survivors first in slot
    order: keys and values (B, H, G, D) in keys' dtype (float32 sums; padding 0), positions (B, H, G) (-1 past
    the survivors), merged (B, H, G) in merged's dtype (the group's degree - 1; padding 0) and source
    (B, H, G) long, the input slot each survivor was (0 past the survivors), for states that follow it.
    """
    if use_triton("merge_into_partners", keys):
        from kvbench.kernels import triton_partner_merge

        return triton_partner_merge.merge_into_partners(keys, values, positions, merged, lengths, absorbed,
                                                        partner, capacity)
    B, H, T = positions.shape
    slots = torch.arange(T, device=keys.device).expand(B, H, T)
    valid = slots < lengths.unsqueeze(-1)
    survivor = valid & ~absorbed
    rank = survivor.long().cumsum(-1) - 1  # new index of every surviving slot
    groups = torch.where(valid, rank.gather(2, torch.where(absorbed, partner, slots)), -1)
    degree = (merged.float() + 1) * valid
    cluster_degree = group_sum(degree, groups, capacity)  # (B, H, G)
    weight = degree / cluster_degree.gather(2, groups.clamp(min=0)).clamp(min=1)
    into = torch.where(survivor, rank, capacity)  # survivors to their rank, the rest to a spare last slot

    def follow(x: Tensor, fill: int) -> Tensor:
        return x.new_full((B, H, capacity + 1), fill).scatter_(2, into, x)[..., :capacity].contiguous()

    return (scatter_merge(keys, groups, weight, capacity), scatter_merge(values, groups, weight, capacity),
            follow(positions, -1), (cluster_degree - 1).clamp(min=0).to(merged.dtype), follow(slots, 0))
