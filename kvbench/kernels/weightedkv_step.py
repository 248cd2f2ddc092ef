"""WeightedKV's decode step in place, and the rules it shares with WeightedKV's ``compress``.

One row of ``keep + 1`` slots (any slot order; positions say which token a slot holds) loses one slot: the
mergeable region's lowest average attention a_bar = a / n (ties: the oldest position; never-observed slots
after every observed one) merges its value into the slot holding the next position,
v_r <- f v_j + (1 - f) v_r with f = a_bar_j / (a_bar_j + a_bar_r), and leaves (the row's last slot moves into
its slot). Keys, a and n of the other slots stay. No next position (a row whose every later token is gone,
which the budget rule never produces): nothing is merged.

Torch reference; ``triton_weightedkv_step`` holds the three- or four-launch kernel of the same signature
(``dispatch``).
Shapes: keys (B, H, C, D); values (B, H, C, DV); positions (B, H, C) long; lengths (B, H) long; state
(S, B, H, C) float32, every per-slot state stacked, ``accumulated`` (a) and ``observed`` (n) two of its rows;
n_keep (B,) long, the budget of each batch row. ``newest_last``: the caller knows that each row's newest position is
its last real slot's (a decode step's, which appended it there): the Triton step reads it there instead of scanning
the row's positions for it; the reference takes the maximum either way, the same position.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvbench.kernels.dispatch import use_triton
from kvbench.kernels.slots import move_last_into, next_slots, select_lowest


def protection(keep: Tensor, sinks: int, recent: int | None) -> tuple[Tensor, Tensor]:
    """(sinks, recent), (B, H) each, of a (B, H) budget m: sinks + recent <= m - 1 (``recent=None``: the paper's
    proportion, sinks + recent = m / 2), so that a region to merge from always remains."""
    row_sinks = torch.minimum(keep.clamp(max=sinks), keep - 1)
    wanted = keep // 2 - row_sinks if recent is None else torch.full_like(keep, recent)
    return row_sinks, torch.minimum(wanted.clamp(min=1), (keep - row_sinks).clamp(min=1))


def average_attention(accumulated: Tensor, observed: Tensor) -> Tensor:
    """a_bar = a / n (B, H, T), 0 / 1 on never-observed slots."""
    return accumulated / observed.clamp(min=1)


def merge_key(average: Tensor, observed: Tensor) -> Tensor:
    """(B, H, T) what the merge order ascends: a_bar, never-observed slots after every observed one."""
    return torch.where(observed > 0, average, torch.finfo(torch.float32).max)


def pair_fraction(w_j: Tensor, w_r: Tensor) -> Tensor:
    """f, the share of v_j in the merge v_r <- f v_j + (1 - f) v_r: a_bar[j] / (a_bar[j] + a_bar[r]), 1/2 when
    both are 0."""
    total = w_j + w_r
    return torch.where(total > 0, w_j / total.clamp(min=torch.finfo(torch.float32).tiny), 0.5)


def weightedkv_step(keys: Tensor, values: Tensor, positions: Tensor, lengths: Tensor, state: Tensor,
                    accumulated: Tensor, observed: Tensor, n_keep: Tensor, sinks: int, recent: int | None,
                    newest_last: bool = False) -> None:
    """Merge and remove one slot of every row in place (module docstring); ``lengths`` drop by one."""
    if use_triton("weightedkv_step", values):
        from kvbench.kernels import triton_weightedkv_step

        return triton_weightedkv_step.weightedkv_step(keys, values, positions, lengths, state, accumulated,
                                                      observed, n_keep, sinks, recent, newest_last)
    keep = torch.minimum(n_keep.to(lengths).unsqueeze(-1), lengths)  # (B, H)
    row_sinks, row_recent = protection(keep, sinks, recent)
    average = average_attention(accumulated, observed)  # (B, H, C)
    j = select_lowest(merge_key(average, observed), lengths, positions, row_sinks, row_recent)  # (B, H)
    following, real = next_slots(positions, lengths, j, 1)  # (B, H, 1) each
    r = following.squeeze(-1)
    f = pair_fraction(average.gather(2, j.unsqueeze(-1)), average.gather(2, r.unsqueeze(-1))).unsqueeze(-1)
    at_j, at_r = (i.view(*i.shape, 1, 1).expand(-1, -1, 1, values.shape[-1]) for i in (j, r))
    v_j, v_r = values.gather(2, at_j).float(), values.gather(2, at_r).float()
    merged = torch.where(real.unsqueeze(-1), f * v_j + (1 - f) * v_r, v_r)
    values.scatter_(2, at_r, merged.to(values.dtype))
    move_last_into(j, lengths, keys, values, positions, state)
