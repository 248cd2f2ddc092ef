"""In-place decode compression of one slot per row: pick the slot, remove it by moving the row's last slot in.

A decode step of a method that compresses every step drops one slot of every row. Re-gathering the cache
for that costs a pass over all of it; these operations touch one slot per row instead, and never read a
device value back (a CUDA graph replays them). Rows are in any slot order (positions say which token a slot
holds). Torch references; ``triton_slots`` holds one-launch kernels of the same signatures (see ``dispatch``).

Shapes: scores, positions (B, H, C); lengths, sinks, recent, victim (B, H) long; keys/values (B, H, C, D);
state (S, B, H, C) float32 (every per-slot state of the layer, stacked; S may be 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvbench.kernels.dispatch import use_triton
from kvbench.kernels.select import eviction_order, heavy_split


def select_lowest(scores: Tensor, lengths: Tensor, positions: Tensor, sinks: Tensor, recent: Tensor) -> Tensor:
    """(B, H) the real slot of lowest score that is not protected; ties go to the oldest position (the
    choice of a position-ordered row, whatever the slot order); slot 0 when every slot is protected.

    Protected: the first ``sinks`` slots (sinks stay in the slots prefill put them in: nothing ever moves into
    or out of them) and the slots holding the row's ``recent`` newest positions (the window's positions are
    contiguous whenever it was always kept, so a threshold on the newest position finds them)."""
    if use_triton("select_lowest", scores):
        from kvbench.kernels import triton_slots

        return triton_slots.select_lowest(scores, lengths, positions, sinks, recent)
    slots = torch.arange(scores.shape[-1], device=scores.device)
    valid = slots < lengths.unsqueeze(-1)
    newest = torch.where(valid, positions, -1).amax(-1, keepdim=True)
    free = valid & (slots >= sinks.unsqueeze(-1)) & (positions <= newest - recent.unsqueeze(-1))
    score = torch.where(free, scores.float(), torch.inf)
    lowest = free & (score == score.amin(-1, keepdim=True))
    return torch.where(lowest, positions, torch.iinfo(positions.dtype).max).argmin(-1)


def next_slots(positions: Tensor, lengths: Tensor, slot: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """The real slots holding the ``count`` positions that follow slot ``slot`` (B, H) in its row, oldest first:
    (slots (B, H, count) long, real (B, H, count) bool: False past the row's newest position, where the slot
    index is arbitrary). What "the next n slots" of a position-ordered row are, in any slot order."""
    valid = torch.arange(positions.shape[-1], device=positions.device) < lengths.unsqueeze(-1)
    later = valid & (positions > positions.gather(2, slot.unsqueeze(-1)))
    none = torch.iinfo(positions.dtype).max
    following = torch.where(later, positions, none).topk(min(count, positions.shape[-1]), largest=False)
    return following.indices, following.values < none


def move_last_into(victim: Tensor, lengths: Tensor, keys: Tensor, values: Tensor, positions: Tensor,
                   state: Tensor) -> None:
    """Remove slot ``victim`` of every row: the row's last slot moves into it, the row shrinks by one."""
    if use_triton("move_last_into", keys):
        from kvbench.kernels import triton_slots

        return triton_slots.move_last_into(victim, lengths, keys, values, positions, state)
    last = (lengths - 1).unsqueeze(-1)  # (B, H, 1)
    dest = victim.unsqueeze(-1)
    for t in (keys, values):
        rows = last.unsqueeze(-1).expand(-1, -1, -1, t.shape[-1])
        t.scatter_(2, dest.unsqueeze(-1).expand_as(rows), t.gather(2, rows))
    positions.scatter_(2, dest, positions.gather(2, last))
    if state.shape[0]:
        S = state.shape[0]
        state.scatter_(3, dest.expand(S, *dest.shape), state.gather(3, last.expand(S, *last.shape)))
    lengths -= 1


def budget_victim(scores: Tensor | None, lengths: Tensor, positions: Tensor, n_keep: Tensor, sinks: int,
                  heavy_ratio: float | None) -> Tensor:
    """(B, H) the slot a row of keep = min(n_keep, length) + 1 slots drops under its budget's protection: H2O's
    split (``heavy_ratio``: ``select.heavy_split`` of keep, the lowest of ``scores`` outside the sinks and the
    recent window) or, with ``heavy_ratio=None``, StreamingLLM's order (``select.eviction_order``: the oldest
    after the sinks; ``scores`` unused). n_keep: (B,) long."""
    keep = torch.minimum(n_keep.to(lengths).unsqueeze(-1), lengths)  # (B, H)
    if heavy_ratio is None:
        scores, row_sinks, recent = eviction_order(positions, keep, sinks)
    else:
        row_sinks, recent = (t.squeeze(-1) for t in heavy_split(keep, heavy_ratio, sinks))
    return select_lowest(scores, lengths, positions, row_sinks, recent)


def evict_in_budget(scores: Tensor | None, lengths: Tensor, positions: Tensor, n_keep: Tensor, sinks: int,
                    heavy_ratio: float | None, keys: Tensor, values: Tensor, state: Tensor) -> None:
    """``budget_victim`` then ``move_last_into``: H2O's and StreamingLLM's decode step, the protected counts derived
    from the budget on the device (in Triton a launch per phase over blocks of the rows, two or three, where torch
    takes about ten small operations)."""
    if use_triton("evict_in_budget", keys):
        from kvbench.kernels import triton_slots

        return triton_slots.evict_in_budget(scores, lengths, positions, n_keep, sinks, heavy_ratio, keys, values,
                                            state)
    move_last_into(budget_victim(scores, lengths, positions, n_keep, sinks, heavy_ratio), lengths, keys, values,
                   positions, state)


def evict_lowest(scores: Tensor, lengths: Tensor, positions: Tensor, sinks: Tensor, recent: Tensor,
                 keys: Tensor, values: Tensor, state: Tensor) -> None:
    """``select_lowest`` then ``move_last_into`` (two or three launches in Triton, over blocks of the rows)."""
    if use_triton("evict_lowest", scores):
        from kvbench.kernels import triton_slots

        return triton_slots.evict_lowest(scores, lengths, positions, sinks, recent, keys, values, state)
    move_last_into(select_lowest(scores, lengths, positions, sinks, recent), lengths, keys, values, positions,
                   state)
