"""Triton twins of ``lut_expand``: EMS's expanded view written in two launches, and its fold in one.

``expand_lut``: a cumulative count of the live members per row (torch ``cumsum`` and a few elementwise
operations over the table) gives every member its place; then one program per (row, tile) writes a tile of
stored slots (first launch) or of LUT entries (second launch) straight to its place in the view. Every entry of the view is written exactly once: stored slot s < length to s,
live member j to length + (live members before j), dead member j to view_length + (dead members before j),
stored padding s >= length to view_length + (dead members) + (s - length), both as padding.

``fold_entries``: one program per (row, tile of entries) adds each entry below the row's length onto its
stored slot with a float32 atomic add.

``centre_slots``, given a bound on the positions (``position_limit``, what a decode step's host knows): one
program per (row, tile of slots) writes every real slot's index at its position in a (B, H, limit) int32 map,
and one program per (row, tile of entries) reads every entry's centre there and keeps the slot only where the
slot is real and holds that position. Positions are unique in a row, so a stored centre's entry was written by
this call; any other entry of the map (never written: ``torch.empty``, or left by an earlier call) names a
slot that fails the check, so the map needs no clearing. Two launches, no sort. Without a bound: one program
per (row, tile of slots) writes the sort's input (a real slot's position as int32, INT32_MAX past the row's
length), torch sorts each row (about ten launches on a GPU), and one program per (row, tile of entries)
binary-searches every entry's centre in its row (lower bound, as ``torch.searchsorted``). Both give the
reference's integers; the reference takes about twenty elementwise operations, gathers and the sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvbench.kernels.triton_slots import lower_bound

BLOCK = 32  # entries per program of the expansion
FOLD_BLOCK = 1024  # entries per program of the fold
SLOTS_BLOCK = 1024  # slots or table entries per program of ``centre_slots``
INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def _lut_expand(
    k_ptr, v_ptr, pos_ptr, len_ptr, slot_ptr, cum_ptr, live_ptr, mdest_ptr, lpos_ptr, lnorm_ptr, mk_ptr,
    ok_ptr, ov_ptr, opos_ptr, oslot_ptr, olen_ptr,
    skb, skh, skt, skd, svb, svh, svt, svd, smb, smh, sme, smd,
    H, T, E, D, DV,
    MEMBERS: tl.constexpr, HAS_MEMBER_KEYS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One tile of the view: stored slots (``MEMBERS`` false: grid (rows, T tiles)) or look-up-table entries
    (grid (rows, E tiles)): two launches of one kernel, the branch resolved at compile time, so that neither
    variant carries the other's tensors through a runtime branch."""
    row, tile = tl.program_id(0).to(tl.int64), tl.program_id(1)  # int64 offsets: large batches pass 2^31 elements
    b, h = row // H, row % H
    C = T + E
    length = tl.load(len_ptr + row)
    live_total = tl.load(cum_ptr + row * E + E - 1)
    view_length = length + live_total
    d, dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    in_d, in_dv = d[None, :] < D, dv[None, :] < DV
    if not MEMBERS:
        s = tile * BLOCK + tl.arange(0, BLOCK)
        inside = s < T
        real = s < length
        dest = tl.where(real, s, view_length + (E - live_total) + (s - length))
        key = tl.load(k_ptr + b * skb + h * skh + s[:, None] * skt + d[None, :] * skd, mask=real[:, None] & in_d,
                      other=0.0)
        value = tl.load(v_ptr + b * svb + h * svh + s[:, None] * svt + dv[None, :] * svd,
                        mask=real[:, None] & in_dv, other=0.0)
        position = tl.load(pos_ptr + row * T + s, mask=real, other=-1)
        source = tl.where(real, s, 0).to(tl.int64)
        if tile == 0:
            tl.store(olen_ptr + row, view_length)
    else:
        j = tile * BLOCK + tl.arange(0, BLOCK)
        inside = j < E
        # live flags and destinations come computed (``expand_lut``): derived here from the prefix counts, they
        # make Triton 3.6's layout pass emit a mislaid select
        real = inside & (tl.load(live_ptr + row * E + j, mask=inside, other=0) != 0)
        dest = tl.load(mdest_ptr + row * E + j, mask=inside, other=0)
        source = tl.load(slot_ptr + row * E + j, mask=real, other=0).to(tl.int64)
        if HAS_MEMBER_KEYS:
            x = tl.load(mk_ptr + b * smb + h * smh + j[:, None] * sme + d[None, :] * smd, mask=real[:, None] & in_d,
                        other=0.0).to(tl.float32)
        else:
            x = tl.load(k_ptr + b * skb + h * skh + source[:, None] * skt + d[None, :] * skd,
                        mask=real[:, None] & in_d, other=0.0).to(tl.float32)
        norm = tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), 1e-12)  # F.normalize's eps
        member_norm = tl.load(lnorm_ptr + row * E + j, mask=real, other=0.0).to(tl.float32)
        key = (x / norm[:, None]) * member_norm[:, None]
        value = tl.load(v_ptr + b * svb + h * svh + source[:, None] * svt + dv[None, :] * svd,
                        mask=real[:, None] & in_dv, other=0.0)
        position = tl.load(lpos_ptr + row * E + j, mask=real, other=-1)
    tl.store(ok_ptr + (row * C + dest[:, None]) * D + d[None, :], key.to(ok_ptr.dtype.element_ty),
             mask=inside[:, None] & in_d)
    tl.store(ov_ptr + (row * C + dest[:, None]) * DV + dv[None, :], value.to(ov_ptr.dtype.element_ty),
             mask=inside[:, None] & in_dv)
    tl.store(opos_ptr + row * C + dest, position, mask=inside)
    tl.store(oslot_ptr + row * C + dest, source, mask=inside)


def expand_lut(keys: Tensor, values: Tensor, positions: Tensor, lengths: Tensor, slot: Tensor, live: Tensor,
               lut_position: Tensor, lut_norm: Tensor, member_keys: Tensor | None = None,
               ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Triton ``lut_expand.expand_lut`` (E >= 1)."""
    B, H, T, D = keys.shape
    E, DV = slot.shape[-1], values.shape[-1]
    C = T + E
    cum = live.long().cumsum(-1).contiguous()
    out_keys = keys.new_empty(B, H, C, D)
    out_values = values.new_empty(B, H, C, DV)
    out_positions = positions.new_empty(B, H, C)
    out_slot = slot.new_empty(B, H, C)
    out_lengths = torch.empty_like(lengths)
    mk = keys if member_keys is None else member_keys
    mk_strides = (0, 0, 0, 0) if member_keys is None else member_keys.stride()
    # where each table entry goes: live members after the row's stored slots in table order, the others after
    # every live entry (the view's padding), in table order too
    entry = torch.arange(E, device=keys.device)
    member_dest = torch.where(live, lengths.unsqueeze(-1) + cum - 1,
                              (lengths + cum[..., -1]).unsqueeze(-1) + entry - cum).contiguous()
    args = (keys, values, positions.contiguous(), lengths.contiguous(), slot.contiguous(), cum,
            live.to(torch.int8).contiguous(), member_dest,
            lut_position.contiguous(), lut_norm.contiguous(), mk, out_keys, out_values, out_positions, out_slot,
            out_lengths, *keys.stride(), *values.stride(), *mk_strides, H, T, E, D, DV)
    blocks = dict(BLOCK=BLOCK, BLOCK_D=triton.next_power_of_2(D), BLOCK_DV=triton.next_power_of_2(DV))
    _lut_expand[(B * H, triton.cdiv(T, BLOCK))](*args, MEMBERS=False, HAS_MEMBER_KEYS=False, **blocks)
    _lut_expand[(B * H, triton.cdiv(E, BLOCK))](*args, MEMBERS=True, HAS_MEMBER_KEYS=member_keys is not None,
                                                **blocks)
    return out_keys, out_values, out_positions, out_slot, out_lengths


@triton.jit
def _lut_fold(stats_ptr, slot_ptr, len_ptr, out_ptr, Hs, group, C, capacity, BLOCK: tl.constexpr):
    row, tile = tl.program_id(0).to(tl.int64), tl.program_id(1)
    kv_row = (row // Hs) * (Hs // group) + (row % Hs) // group
    length = tl.load(len_ptr + kv_row)
    e = tile * BLOCK + tl.arange(0, BLOCK)
    real = e < length
    slot = tl.load(slot_ptr + kv_row * C + e, mask=real, other=0)
    stat = tl.load(stats_ptr + row * C + e, mask=real, other=0.0)
    # relaxed: nothing reads the sums before the launch ends
    tl.atomic_add(out_ptr + row * capacity + slot, stat, mask=real, sem="relaxed")


def fold_entries(stats: Tensor, slot: Tensor, lengths: Tensor, capacity: int) -> Tensor:
    """Triton ``lut_expand.fold_entries``."""
    B, Hs, C = stats.shape
    out = torch.zeros(B, Hs, capacity, dtype=stats.dtype, device=stats.device)
    _lut_fold[(B * Hs, triton.cdiv(C, FOLD_BLOCK))](stats.contiguous(), slot.contiguous(), lengths.contiguous(), out,
                                                Hs, Hs // slot.shape[1], C, capacity, BLOCK=FOLD_BLOCK)
    return out


@triton.jit
def _stored_positions(pos_ptr, len_ptr, out_ptr, H, T, spb, sph, spt, slb, slh, BLOCK: tl.constexpr):
    row, tile = tl.program_id(0).to(tl.int64), tl.program_id(1)
    b, h = row // H, row % H
    s = tile * BLOCK + tl.arange(0, BLOCK)
    length = tl.load(len_ptr + b * slb + h * slh)
    position = tl.load(pos_ptr + b * spb + h * sph + s * spt, mask=s < T, other=0)
    tl.store(out_ptr + row * T + s, tl.where(s < length, position.to(tl.int32), INT32_MAX), mask=s < T)


@triton.jit
def _centre_lookup(sorted_ptr, order_ptr, centre_ptr, slot_ptr, live_ptr, H, T, E, scb, sch, sce,
                   STEPS: tl.constexpr, BLOCK: tl.constexpr):
    row, tile = tl.program_id(0).to(tl.int64), tl.program_id(1)
    b, h = row // H, row % H
    j = tile * BLOCK + tl.arange(0, BLOCK)
    inside = j < E
    centre = tl.load(centre_ptr + b * scb + h * sch + j * sce, mask=inside, other=-1)
    at = tl.minimum(lower_bound(sorted_ptr + row * T, T, centre.to(tl.int32), STEPS), T - 1)
    found = tl.load(sorted_ptr + row * T + at, mask=inside, other=INT32_MAX)
    live = (found.to(tl.int64) == centre) & (centre >= 0)
    slot = tl.load(order_ptr + row * T + at, mask=inside & live, other=0)
    tl.store(slot_ptr + row * E + j, tl.where(live, slot, 0), mask=inside)
    tl.store(live_ptr + row * E + j, live, mask=inside)


@triton.jit
def map_positions(map_ptr, row, s, real, position, LIMIT):
    """map[row, position of slot s] = s for the real slots ``s`` of a tile."""
    tl.store(map_ptr + row * LIMIT + position, s.to(tl.int32), mask=real & (position >= 0) & (position < LIMIT))


@triton.jit
def mapped_centres(map_ptr, pos_ptr, centre_ptr, row, b, h, j, inside, length, T, LIMIT, spb, sph, spt,
                   scb, sch, sce):
    """(slot, live) of the table entries ``j`` of a row: the slot the map names for each entry's centre, where that
    slot is real and holds the centre's position (0 and False elsewhere)."""
    centre = tl.load(centre_ptr + b * scb + h * sch + j * sce, mask=inside, other=-1)
    mapped = inside & (centre >= 0) & (centre < LIMIT)
    slot = tl.load(map_ptr + row * LIMIT + centre, mask=mapped, other=-1).to(tl.int64)
    real = mapped & (slot >= 0) & (slot < tl.minimum(length, T))
    held = tl.load(pos_ptr + b * spb + h * sph + slot * spt, mask=real, other=-1)
    live = real & (held == centre)
    return tl.where(live, slot, 0), live


@triton.jit
def _position_map(pos_ptr, len_ptr, map_ptr, H, T, LIMIT, spb, sph, spt, slb, slh, BLOCK: tl.constexpr):
    row, tile = tl.program_id(0).to(tl.int64), tl.program_id(1)
    b, h = row // H, row % H
    s = tile * BLOCK + tl.arange(0, BLOCK)
    real = s < tl.minimum(tl.load(len_ptr + b * slb + h * slh), T)
    map_positions(map_ptr, row, s, real, tl.load(pos_ptr + b * spb + h * sph + s * spt, mask=real, other=0), LIMIT)


@triton.jit
def _map_lookup(map_ptr, pos_ptr, len_ptr, centre_ptr, slot_ptr, live_ptr, H, T, E, LIMIT, spb, sph, spt, slb, slh,
                scb, sch, sce, BLOCK: tl.constexpr):
    row, tile = tl.program_id(0).to(tl.int64), tl.program_id(1)
    b, h = row // H, row % H
    j = tile * BLOCK + tl.arange(0, BLOCK)
    inside = j < E
    length = tl.load(len_ptr + b * slb + h * slh)
    slot, live = mapped_centres(map_ptr, pos_ptr, centre_ptr, row, b, h, j, inside, length, T, LIMIT, spb, sph, spt,
                                scb, sch, sce)
    tl.store(slot_ptr + row * E + j, slot, mask=inside)
    tl.store(live_ptr + row * E + j, live, mask=inside)


def centre_slots(positions: Tensor, lengths: Tensor, centre: Tensor, position_limit: int | None = None
                 ) -> tuple[Tensor, Tensor]:
    """Triton ``lut_expand.centre_slots``."""
    B, H, T = positions.shape
    if position_limit is not None:
        position_map = torch.empty(B, H, position_limit, dtype=torch.int32, device=positions.device)
        return slots_through_map(positions, lengths, centre, position_map)
    E = centre.shape[-1]
    stored = torch.empty(B, H, T, dtype=torch.int32, device=positions.device)
    _stored_positions[(B * H, triton.cdiv(T, SLOTS_BLOCK))](positions, lengths, stored, H, T, *positions.stride(),
                                                           *lengths.stride(), BLOCK=SLOTS_BLOCK)
    sorted_positions, order = stored.sort(dim=-1)
    slot = torch.empty(B, H, E, dtype=torch.long, device=positions.device)
    live = torch.empty(B, H, E, dtype=torch.bool, device=positions.device)
    _centre_lookup[(B * H, triton.cdiv(E, SLOTS_BLOCK))](sorted_positions, order, centre, slot, live, H, T, E,
                                                        *centre.stride(), STEPS=max(1, T.bit_length()),
                                                        BLOCK=SLOTS_BLOCK)
    return slot, live


def slots_through_map(positions: Tensor, lengths: Tensor, centre: Tensor, position_map: Tensor
                      ) -> tuple[Tensor, Tensor]:
    """``centre_slots`` through ``position_map`` (B, H, limit) int32, whatever it holds (the module doc)."""
    B, H, T = positions.shape
    E, limit = centre.shape[-1], position_map.shape[-1]
    _position_map[(B * H, triton.cdiv(T, SLOTS_BLOCK))](positions, lengths, position_map, H, T, limit,
                                                        *positions.stride(), *lengths.stride(), BLOCK=SLOTS_BLOCK)
    slot = torch.empty(B, H, E, dtype=torch.long, device=positions.device)
    live = torch.empty(B, H, E, dtype=torch.bool, device=positions.device)
    _map_lookup[(B * H, triton.cdiv(E, SLOTS_BLOCK))](position_map, positions, lengths, centre, slot, live, H, T, E,
                                                     limit, *positions.stride(), *lengths.stride(), *centre.stride(),
                                                     BLOCK=SLOTS_BLOCK)
    return slot, live
