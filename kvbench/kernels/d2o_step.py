"""D2O's decode step in place, and the rules it shares with D2O's ``compress`` (protected counts, EMA
threshold, merge weights).

One row of ``keep + 1`` slots (any slot order; positions say which token a slot holds) loses one slot: the
lowest accumulated attention outside the sinks and the recent window (ties: the oldest position) finds its most
similar other slot by key cosine u (ties: the oldest position); the row's EMA threshold takes u
(``threshold_scope=layer``: the mean u over the batch row's heads); when u passes it, the victim merges into
that slot (keys and values, ``merge_terms``' weights); every slot of the row takes the new threshold, and the
row's last slot moves into the victim's.

Torch reference; ``triton_d2o_step`` holds the four-launch kernel of the same signature (``dispatch``).
Shapes: keys (B, H, C, D); values (B, H, C, DV); positions (B, H, C) long; lengths (B, H) long; state
(S, B, H, C) float32, every per-slot state stacked, ``attention`` and ``threshold`` two of its rows (the row's
threshold repeated on every slot, NaN before the first eviction); n_keep (B,) long.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from kvbench.kernels.dispatch import use_triton
from kvbench.kernels.similarity import slot_best_match
from kvbench.kernels.slots import move_last_into, select_lowest


def protection(keep: Tensor, n_heavy: int, n_recent: int, n_sinks: int) -> tuple[Tensor, Tensor]:
    """(sinks, recent), (B, H) each, of a (B, H) budget: the recent share floored, sinks inside the rest."""
    recent = torch.div(keep * n_recent, n_heavy + n_recent, rounding_mode="floor")
    return (keep - recent).clamp(max=n_sinks), recent


def ema_threshold(previous: Tensor, total: Tensor, count: Tensor, beta: float, layer_scope: bool) -> Tensor:
    """This step's EMA threshold (B, H) from the previous one (NaN: none yet) and each row's sum and number
    (float) of the similarities u_e of its evicted slots (``layer_scope``: summed over the heads of each batch
    row); rows without evictions keep the previous one."""
    if layer_scope:
        total = total.sum(-1, keepdim=True).expand_as(total)
        count = count.sum(-1, keepdim=True).expand_as(count)
    current = total / count.clamp(min=1)
    smoothed = torch.where(previous.isnan(), current, beta * current + (1 - beta) * previous)
    return torch.where(count > 0, smoothed, previous)


def merge_terms(similarity: Tensor, weighted: bool) -> tuple[float, Tensor, Tensor]:
    """The merge rule: (a kept slot's own weight, which is also its share of the normaliser; the raw weight
    and the normaliser share of an evicted slot of cosine u merged into it). A merged kept slot's weights are
    raw / (its own share + its merged slots' shares). ``weighted``: Z = e^1 + sum exp(u_e) [P Eqs. 11-12];
    else the authors' code, (k_c + sum u_e k_e) / (1 + |E_c|)."""
    if weighted:
        return math.e, similarity.exp(), similarity.exp()
    return 1.0, similarity, torch.ones_like(similarity)


def d2o_step(keys: Tensor, values: Tensor, positions: Tensor, lengths: Tensor, state: Tensor, attention: Tensor,
             threshold: Tensor, n_keep: Tensor, n_heavy: int, n_recent: int, n_sinks: int, beta: float,
             layer_scope: bool, weighted: bool, newest_last: bool = False,
             step: Callable[..., Tensor] | None = None) -> None:
    """Merge and remove one slot of every row in place (module docstring); ``lengths`` drop by one.
    ``newest_last``: each row's newest position is its last real slot's (a decode step appended it there): the
    Triton step reads it there instead of scanning; here the maximum, the same position. ``step``: the pass's
    step attention, pending (``AttentionStats.pending_step``), added to ``attention`` first (D2O's ``observe``);
    the Triton step makes it inside its first launch."""
    if use_triton("d2o_step", keys):
        from kvbench.kernels import triton_d2o_step

        return triton_d2o_step.d2o_step(keys, values, positions, lengths, state, attention, threshold, n_keep,
                                        n_heavy, n_recent, n_sinks, beta, layer_scope, weighted, newest_last, step)
    if step is not None:
        step(into=attention)
    keep = torch.minimum(n_keep.to(lengths).unsqueeze(-1), lengths)  # (B, H)
    victim = select_lowest(attention, lengths, positions, *protection(keep, n_heavy, n_recent, n_sinks))
    slots = torch.arange(positions.shape[-1], device=positions.device)
    others = (slots < lengths.unsqueeze(-1)) & (slots != victim.unsqueeze(-1))
    similarity, match = slot_best_match(keys, positions, victim, others)  # (B, H) each
    tau = ema_threshold(threshold[:, :, 0], similarity, torch.ones_like(similarity), beta, layer_scope)
    merged = (match >= 0) & (similarity >= tau)
    own, merged_raw, merged_mass = merge_terms(similarity, weighted)
    norm = (own + torch.where(merged, merged_mass, 0.0)).clamp(min=1e-12)
    own = torch.full_like(norm, own)  # divided as a tensor, as compress does (float / tensor multiplies by 1/x)
    own, incoming = ((w / norm).view(*norm.shape, 1, 1) for w in (own, torch.where(merged, merged_raw, 0.0)))
    target, source = match.clamp(min=0).view(*match.shape, 1, 1), victim.view(*victim.shape, 1, 1)
    for t in (keys, values):  # unmerged: the target is rewritten with weight 1 on itself, 0 on the victim
        at_target, at_victim = (i.expand(-1, -1, 1, t.shape[-1]) for i in (target, source))
        mixed = own * t.gather(2, at_target).float() + incoming * t.gather(2, at_victim).float()
        t.scatter_(2, at_target, mixed.to(t.dtype))
    threshold.copy_(tau.unsqueeze(-1).expand_as(threshold))
    move_last_into(victim, lengths, keys, values, positions, state)
