"""EMS's look-up-table expansion: the entries a pass's attention reads instead of the stored slots, and the
fold of the pass's statistics back onto the stored slots (``methods.ems``, ``kv.Expansion``).

``expand_lut`` writes, per row ``(b, h)``, the stored slots ``[0, length)`` in slot order, then every live
LUT member in table order as ``||k_j|| * unit(source_j)`` with its centre's value, then padding (zero keys
and values, position -1, slot 0) up to the static width C = T + E: the view's length is ``length`` plus the
row's live members. ``source_j`` is the centre's stored key (``member_keys`` None: "w.o. pos") or the
caller's member keys (the centre's key rotated to the member's position: "w. pos").

Shapes: keys (B, H, T, D), values (B, H, T, D_v), positions (B, H, T), lengths (B, H) long;
slot (B, H, E) long: the stored slot of every member's centre (any value where not live); live (B, H, E)
bool; lut_position (B, H, E) long; lut_norm (B, H, E) float32; member_keys None or (B, H, E, D).
Returns keys (B, H, C, D) and values (B, H, C, D_v) in the storage dtypes, positions (B, H, C), the stored
slot of every entry (B, H, C) long, and the view's lengths (B, H).

This is the torch reference (gathers, a concatenation and a stable sort that left-aligns the attended
entries); ``triton_lut_expand`` writes the view in two launches after a cumulative count of the live members.
``centre_slots`` finds the ``slot`` and ``live`` that the view and ``lut_attention`` take.
The member keys differ only by how ||source|| is summed: float32 sums in another order, so a stored key of a
bfloat16 cache may round to the neighbouring bfloat16 (one unit in the last place, 2^-7 relative).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvbench.kernels.dispatch import use_triton
from kvbench.kernels.select import true_first
from kvbench.kernels.similarity import unit_keys


def centre_slots(positions: Tensor, lengths: Tensor, centre: Tensor, position_limit: int | None = None
                 ) -> tuple[Tensor, Tensor]:
    """(B, H, E) long: the stored slot of every LUT member's centre, found by its position ``centre`` (B, H, E)
    long (0 where not live); and (B, H, E) bool: whether the entry is a member whose centre is stored (False
    on unused entries, centre -1). ``positions`` (B, H, T), ``lengths`` (B, H): the stored slots, a position
    at most once among a row's real slots. ``position_limit``: None, or a bound the caller knows on the host
    that every real slot's position is below (a pass's ``PassPlan.position_limit``).

    A binary search in the sorted stored positions: O((E + T) log T), where comparing every entry with every
    slot would hold an (E x T) mask per head at each step. Positions are sorted as int32 (token indices fit):
    a radix sort of half the key bits, half the passes. EMS's decode step runs this at every layer, on the
    step's critical path: the Triton twin, given the bound, writes each slot at its position in a map of
    ``position_limit`` entries a row and reads the centres there (two launches, no sort; the sort took about
    1.5 ms of EMS's 11 ms step at 32k on an H200); without it, it makes the sort's input and reads its output in
    one launch each. The torch reference takes the map too where it has the bound (on the CPU, EMS's decode step
    at 4k on SmolLM2: 3.5 ms of centre slots a step instead of 10.4 ms by the sort).
    The same integers every way."""
    if use_triton("centre_slots", positions):
        from kvbench.kernels import triton_lut_expand

        return triton_lut_expand.centre_slots(positions, lengths, centre, position_limit)
    slots = torch.arange(positions.shape[-1], device=positions.device)
    valid = slots < lengths.unsqueeze(-1)
    if position_limit is not None:  # the map, as the Triton twin
        spare = position_limit  # the map's last entry, past every real position: padding slots write there
        slot_at = positions.new_full((*positions.shape[:2], spare + 1), -1)
        slot_at.scatter_(-1, torch.where(valid, positions, spare), slots.expand_as(positions))
        found = slot_at.gather(-1, centre.clamp(0, spare))
        live = (found >= 0) & (centre >= 0) & (centre < spare)
        return torch.where(live, found, 0), live
    stored = torch.where(valid, positions.to(torch.int32), torch.iinfo(torch.int32).max)
    sorted_positions, order = stored.sort(dim=-1)
    at = torch.searchsorted(sorted_positions, centre.to(torch.int32).contiguous()).clamp(max=stored.shape[-1] - 1)
    live = (sorted_positions.gather(-1, at) == centre) & (centre >= 0)
    return torch.where(live, order.gather(-1, at), 0), live


def expand_lut(keys: Tensor, values: Tensor, positions: Tensor, lengths: Tensor, slot: Tensor, live: Tensor,
               lut_position: Tensor, lut_norm: Tensor, member_keys: Tensor | None = None,
               ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    if use_triton("expand_lut", keys):
        from kvbench.kernels import triton_lut_expand

        return triton_lut_expand.expand_lut(keys, values, positions, lengths, slot, live, lut_position, lut_norm,
                                            member_keys)
    T = keys.shape[2]
    if member_keys is None:
        member_keys = keys.gather(2, slot.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
    member = (unit_keys(member_keys) * lut_norm.float().unsqueeze(-1)).to(keys.dtype)
    member_values = values.gather(2, slot.unsqueeze(-1).expand(-1, -1, -1, values.shape[-1]))
    stored = torch.arange(T, device=keys.device).expand_as(positions)
    order = true_first(torch.cat([stored < lengths.unsqueeze(-1), live], -1))  # attended entries first
    view_lengths = lengths + live.sum(-1)
    attended = torch.arange(order.shape[-1], device=keys.device) < view_lengths.unsqueeze(-1)

    def rows(stored_rows: Tensor, member_rows: Tensor, fill: float) -> Tensor:
        both = torch.cat([stored_rows, member_rows], 2)
        if both.dim() == 3:
            return torch.where(attended, both.gather(2, order), fill)
        index = order.unsqueeze(-1).expand(-1, -1, -1, both.shape[-1])
        return torch.where(attended.unsqueeze(-1), both.gather(2, index), fill)

    return (rows(keys, member, 0), rows(values, member_values, 0),
            rows(positions, torch.where(live, lut_position, -1), -1), rows(stored, slot, 0), view_lengths)


def fold_entries(stats: Tensor, slot: Tensor, lengths: Tensor, capacity: int) -> Tensor:
    """stats (B, H_s, C) float32 of a view's entries, zero past each row's length -> (B, H_s, capacity) summed
    onto the stored slot of every entry; slot (B, H, C) long and lengths (B, H) are the view's; H_s is H or
    the query heads (head hs reads KV head hs // (H_s / H)). The Triton twin sums only the entries below the
    length, with atomic float32 adds in any order (as CUDA's scatter_add does)."""
    if use_triton("fold_entries", stats):
        from kvbench.kernels import triton_lut_expand

        return triton_lut_expand.fold_entries(stats, slot, lengths, capacity)
    slot = slot.repeat_interleave(stats.shape[1] // slot.shape[1], dim=1)
    return stats.new_zeros(*stats.shape[:2], capacity).scatter_add_(2, slot, stats)
