"""EMS's decode step in place (methods/ems.py: "Decoding"), with its look-up table updated in place, and the
per-step update of its scores (``ems_observe``).

One row of ``keep + 1`` slots (any slot order; positions say which token a slot holds) loses one slot, as
``EMS.compress`` at decode does on the same row:
- score = the Global-Local score of every slot (``global_local_score``, unpooled); the local window is the
  min(keep, L_win) newest positions (always kept, so contiguous: a threshold on the newest finds them);
- the lowest score outside the window (ties: the newest position, as compress's stable descending ranking
  puts it last) becomes the TBM token t when the budget has a TBM share (round((gamma - 1) keep) >= 1),
  else it is evicted;
- t merges into the other centre d of highest redundancy R (ties: the oldest position) if R >= tau, with
  weights (score + merged_mass) normalised over {t, d} (1/2 each when both are 0): values as they are, keys as
  unit raw-key directions rotated to d's position, times d's norm (``lut``) or the weighted norm (``bias``,
  positions=without) or each member's expanded key (``bias``, positions=with); d's merged_mass, merged_tokens
  (and logit_bias = log tokens) follow; otherwise t goes to the zero class;
- the look-up table (``lut``): t's members follow t into d's cluster, or leave with it (freed); a merged t
  joins as a member of d in a free entry, or, with the table full, in place of the member with the oldest
  position if t is newer (compress keeps the newest members);
- the row's last slot moves into t's.
Entries of the other slots keep their state exactly (compress re-derives their merged_mass as
(score + merged_mass) - score, equal up to float32 rounding).

Torch reference; ``triton_ems_step`` holds the kernel of the same signature (three or four launches) (``dispatch``).
Shapes: keys, raw_keys (B, H, C, D); values (B, H, C, DV); positions (B, H, C) long; lengths
(B, H) long; state (S, B, H, C) float32, every per-slot state stacked; ``scores`` (s_glo, s_loc_past,
s_loc_cur) and ``merges`` (merged_mass, merged_tokens, logit_bias or None) rows of it; ``lut`` the tables
(position long, centre long, norm float32), each (B, H, E), or None; n_keep (B,) long.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvbench.kernels.dispatch import use_triton
from kvbench.kernels.redundancy import redundancy, rotate_like
from kvbench.kernels.similarity import unit_keys
from kvbench.kernels.slots import move_last_into

if TYPE_CHECKING:
    from kvbench.attention import Rope


def global_local_score(s_glo: Tensor, s_loc: Tensor, valid: Tensor) -> Tensor:
    """EMS Eq. 2 on (B, H, T) tensors: max(s_Glo * mean(s_Loc) / mean(s_Glo), s_Loc); 0 on padding.

    Means are over each row's real slots (the N cancels). A row without global mass scores by s_Loc alone.
    """
    s_glo, s_loc = s_glo.float() * valid, s_loc.float() * valid
    total_glo = s_glo.sum(-1, keepdim=True)
    ratio = torch.where(total_glo > 0, s_loc.sum(-1, keepdim=True) / total_glo.clamp(min=1e-30), 0.0)
    return torch.maximum(s_glo * ratio, s_loc)


def ems_observe(s_glo: Tensor, s_loc_past: Tensor, s_loc_cur: Tensor, s_loc_cur_queries: Tensor,
                attention: Tensor, lengths: Tensor, window: int) -> None:
    """In place: s_Glo and s_Loc^cur += the pass's attention (B, H, C) on real slots; every ``window`` queries
    the local window rolls (s_Loc^past <- s_Loc^cur, s_Loc^cur <- 0). ``s_loc_cur_queries`` holds the queries
    summed into s_Loc^cur on every real slot of a row (0 on padding)."""
    if use_triton("ems_observe", attention):
        from kvbench.kernels import triton_ems_step

        return triton_ems_step.ems_observe(s_glo, s_loc_past, s_loc_cur, s_loc_cur_queries, attention, lengths,
                                           window)
    valid = torch.arange(attention.shape[-1], device=attention.device) < lengths.unsqueeze(-1)
    step = attention.float() * valid
    s_glo.add_(step)
    cur = s_loc_cur + step
    queries = s_loc_cur_queries.amax(-1, keepdim=True) + 1  # (B, H, 1)
    rolled = queries >= window
    s_loc_past.copy_(torch.where(rolled, cur, s_loc_past))
    s_loc_cur.copy_(torch.where(rolled, 0.0, cur))
    s_loc_cur_queries.copy_(torch.where(rolled, 0, queries).float() * valid)


def tbm_share(keep: Tensor, gamma: float) -> Tensor:
    """(B, H) long: N_tbm = round((gamma - 1) * N_budget) of each row's budget (gamma = inf: unbounded)."""
    if math.isinf(gamma):
        return torch.full_like(keep, torch.iinfo(keep.dtype).max)
    return torch.floor((gamma - 1) * keep.double() + 0.5).long()


def _at(x: Tensor, slot: Tensor) -> Tensor:
    """Rows (B, H, 1, D) of x (B, H, C, D) at slot (B, H)."""
    return x.gather(2, slot.view(*slot.shape, 1, 1).expand(-1, -1, 1, x.shape[-1]))


def ems_step(keys: Tensor, values: Tensor, positions: Tensor, lengths: Tensor, state: Tensor,
             raw_keys: Tensor | None, scores: tuple[Tensor, Tensor, Tensor],
             merges: tuple[Tensor, Tensor, Tensor | None], lut: tuple[Tensor, Tensor, Tensor] | None, n_keep: Tensor,
             window: int, tau: float, gamma: float, similarity: str, with_positions: bool,
             rope: Rope | None = None) -> None:
    """Merge or evict, and remove, one slot of every row in place (module docstring); ``lengths`` drop by one.
    The raw keys come as ``raw_keys`` or, with ``raw_keys=None``, from the stored keys through ``rope``
    (``attention.Rope``): here its ``unrotate`` of every slot; the Triton step derives them in registers, from the
    keys of the slots it reads, rounded as ``unrotate`` rounds them (its RoPE ``frequencies``, 16-bit keys)."""
    if use_triton("ems_step", keys):
        from kvbench.kernels import triton_ems_step

        return triton_ems_step.ems_step(keys, values, positions, lengths, state, raw_keys, scores, merges, lut,
                                        n_keep, window, tau, gamma, similarity, with_positions, rope)
    if raw_keys is None:
        raw_keys = rope.unrotate(keys, positions)
    s_glo, s_loc_past, s_loc_cur = scores
    merged_mass, merged_tokens, logit_bias = merges
    C = positions.shape[-1]
    slots = torch.arange(C, device=positions.device)
    keep = torch.minimum(n_keep.to(lengths).unsqueeze(-1), lengths)  # (B, H)
    valid = slots < lengths.unsqueeze(-1)
    score = global_local_score(s_glo, s_loc_past + s_loc_cur, valid)  # (B, H, C)
    newest = torch.where(valid, positions, -1).amax(-1, keepdim=True)
    candidate = valid & (positions <= newest - keep.clamp(max=window).unsqueeze(-1))  # outside the window
    lowest = candidate & (score == torch.where(candidate, score, torch.inf).amin(-1, keepdim=True))
    t = torch.where(lowest, positions, -1).argmax(-1)  # (B, H): ties to the newest position
    centre = candidate & (slots != t.unsqueeze(-1))
    of_t = [_at(x, t) for x in (raw_keys, keys, values)]  # t's rows (B, H, 1, D), which the merge leaves as they are
    R = redundancy(of_t[0], of_t[2], raw_keys, values, similarity).squeeze(2)  # (B, H, C)
    R = torch.where(centre, R, -1.0)
    best = R.amax(-1)
    d = torch.where(centre & (R == best.unsqueeze(-1)), positions, torch.iinfo(positions.dtype).max).argmin(-1)
    merged = (tbm_share(keep, gamma) >= 1) & (best >= tau)  # (B, H); else t goes to the zero class
    norm_t = of_t[1].float().norm(dim=-1)  # (B, H, 1)
    _merge(keys, values, raw_keys, score, merged_mass, merged_tokens, logit_bias, t, d, merged, lut is not None,
           with_positions, (*of_t, norm_t))
    if lut is not None and lut[0].shape[-1]:
        _update_lut(*lut, positions.gather(2, t.unsqueeze(-1)), positions.gather(2, d.unsqueeze(-1)), norm_t,
                    merged.unsqueeze(-1))
    move_last_into(t, lengths, keys, values, positions, state)


def _merge(keys, values, raw_keys, score, merged_mass, merged_tokens, logit_bias, t, d, merged, lut: bool,
           with_positions: bool, of_t: tuple[Tensor, Tensor, Tensor, Tensor]) -> None:
    """Merge slot t into slot d (B, H) where ``merged``: d's key, value and merge state (see ems_step). ``of_t``:
    t's raw key, key and value (B, H, 1, D) and its key's norm (B, H, 1)."""
    raw_t, key_t, value_t, norm_t = of_t
    raw_d, key_d, value_d = (_at(x, d) for x in (raw_keys, keys, values))
    weight = score + merged_mass  # (B, H, C)
    w_t, w_d = (weight.gather(2, i.unsqueeze(-1)) for i in (t, d))  # (B, H, 1)
    mass = w_t + w_d
    f_t, f_d = (torch.where(mass > 0, w / mass.clamp(min=1e-30), 0.5).unsqueeze(-1) for w in (w_t, w_d))
    shared = unit_keys(unit_keys(raw_d) * f_d + unit_keys(raw_t) * f_t)  # the merged raw direction
    norm_t, norm_d = norm_t.unsqueeze(-1), key_d.float().norm(dim=-1, keepdim=True)
    if lut or not with_positions:
        key = rotate_like(shared, raw_d, key_d)
        key = key * (norm_d if lut else norm_d * f_d + norm_t * f_t)
    else:  # each member expanded at its own position, the entry their weighted mean
        key = rotate_like(shared, raw_d, key_d) * norm_d * f_d + rotate_like(shared, raw_t, key_t) * norm_t * f_t
    value = value_d.float() * f_d + value_t.float() * f_t
    row = merged.view(*merged.shape, 1, 1)
    for x, new in ((keys, key), (values, value)):
        at_d = d.view(*d.shape, 1, 1).expand(-1, -1, 1, x.shape[-1])
        x.scatter_(2, at_d, torch.where(row, new.to(x.dtype), x.gather(2, at_d)))
    tokens = merged_tokens.gather(2, t.unsqueeze(-1)) + 1 + merged_tokens.gather(2, d.unsqueeze(-1)) + 1
    updates = [(merged_mass, mass - score.gather(2, d.unsqueeze(-1))), (merged_tokens, tokens - 1)]
    if logit_bias is not None:
        updates.append((logit_bias, tokens.clamp(min=1).log()))
    for s, new in updates:
        s.scatter_(2, d.unsqueeze(-1), torch.where(merged.unsqueeze(-1), new, s.gather(2, d.unsqueeze(-1))))


def _update_lut(position: Tensor, centre: Tensor, norm: Tensor, p_t: Tensor, p_d: Tensor, norm_t: Tensor,
                merged: Tensor) -> None:
    """The look-up table (B, H, E) after t (position p_t, key norm norm_t, each (B, H, 1)) merged into the slot at
    p_d, or (not ``merged``) left for the zero class."""
    of_t = centre == p_t
    freed = of_t & ~merged
    centre.copy_(torch.where(of_t & merged, p_d, torch.where(freed, -1, centre)))
    position.masked_fill_(freed, -1)
    norm.masked_fill_(freed, -1.0)
    free = position < 0
    entries = torch.arange(position.shape[-1], device=position.device)
    first_free = torch.where(free, entries, position.shape[-1]).argmin(-1, keepdim=True)
    oldest = torch.where(free, torch.iinfo(position.dtype).max, position).argmin(-1, keepdim=True)
    has_free = free.any(-1, keepdim=True)
    entry = torch.where(has_free, first_free, oldest)  # (B, H, 1)
    insert = merged & (has_free | (p_t > position.gather(2, entry)))
    for table, new in ((position, p_t), (centre, p_d), (norm, norm_t)):
        table.scatter_(2, entry, torch.where(insert, new.to(table.dtype), table.gather(2, entry)))
