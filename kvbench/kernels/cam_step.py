"""CaM's decode step in place, and the merge rule it shares with CaM's ``compress`` (the merge probability
and the counter-based Bernoulli draws).

One row of ``keep + 1`` slots (any slot order; positions say which token a slot holds) loses one slot: the slot
the preliminary policy evicts (StreamingLLM: the oldest after the sinks, or the newest when the budget is all
sinks; H2O: the lowest accumulated attention outside the sinks and the recent window, ties to the oldest) adds
m_e x_e / n to the values of the slots holding the next n positions (those that exist), where
p_e = min(1, a_e / mean a of those slots) and m_e ~ Bernoulli(p_e) (``uniform_draws``) or p_e itself; then the
row's last slot moves into its slot. Keys and accumulated attention of the other slots stay.

Torch reference; ``triton_cam_step`` holds the one-launch kernel of the same signature (``dispatch``).
Shapes: keys (B, H, C, D); values (B, H, C, DV); positions (B, H, C) long; lengths (B, H) long; state
(S, B, H, C) float32, every per-slot state stacked, ``attention`` (a) one of its rows; n_keep (B,) long.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvbench.kernels.dispatch import use_triton
from kvbench.kernels.slots import budget_victim, move_last_into, next_slots

MASK32 = 0xFFFFFFFF


def mix32(x):
    """Finalizer of a 32-bit integer hash (xor-shift-multiply rounds), for ints and int64 tensors in
    [0, 2^32): the multipliers are odd and below 2^31, so no int64 product overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & MASK32
    return x ^ (x >> 15)


def draw_key(seed: int, layer: int) -> int:
    """The hash key of one layer's draws."""
    return mix32(mix32(seed & MASK32) ^ layer)


def uniform_draws(key: int, head: Tensor, position: Tensor, step: Tensor) -> Tensor:
    """float32 in [0, 1) (24 random bits), a pure function of (key, head, position, step), broadcast: a
    counter-based generator, so that a slot's draw is the same in any slot order and on any device."""
    x = mix32(key ^ head)
    x = mix32(x ^ (position & MASK32))
    x = mix32(x ^ (step & MASK32))
    return (x >> 8).float() * 2.0**-24


def merge_probability(score: Tensor, total: Tensor, count: Tensor) -> Tensor:
    """p_e = min(1, a_e / mean), the mean a of e's ``count`` targets being ``total / count``; a zero mean gives 1
    if a_e > 0, else 0; no targets give 0. Tensors broadcast against each other."""
    mean = total / count.clamp(min=1)
    ratio = torch.where(mean > 0, score / mean.clamp(min=torch.finfo(torch.float32).tiny), (score > 0).float())
    return torch.where(count > 0, ratio.clamp(0, 1), 0.0)


def cam_step(keys: Tensor, values: Tensor, positions: Tensor, lengths: Tensor, state: Tensor, attention: Tensor,
             n_keep: Tensor, sinks: int, heavy_ratio: float | None, merge_tokens: int, key: int | None,
             newest_last: bool = False) -> None:
    """Merge and remove one slot of every row in place (module docstring); ``lengths`` drop by one.

    heavy_ratio: None for StreamingLLM eviction, else H2O's heavy share; key: ``draw_key`` of the layer, None
    for the deterministic merge (m_e = p_e); newest_last: each row's newest position is its last real slot's (a
    decode step appended it there): the Triton step reads it there instead of scanning; here the maximum, the
    same position."""
    if use_triton("cam_step", values):
        from kvbench.kernels import triton_cam_step

        return triton_cam_step.cam_step(keys, values, positions, lengths, state, attention, n_keep, sinks,
                                        heavy_ratio, merge_tokens, key, newest_last)
    victim = budget_victim(attention, lengths, positions, n_keep, sinks, heavy_ratio)  # (B, H)
    targets, real = next_slots(positions, lengths, victim, merge_tokens)  # (B, H, n) each
    evicted = victim.unsqueeze(-1)  # (B, H, 1)
    total = torch.where(real, attention.gather(2, targets), 0.0).sum(-1, keepdim=True)
    prob = merge_probability(attention.gather(2, evicted), total, real.sum(-1, keepdim=True))
    if key is None:
        mask = prob
    else:
        valid = torch.arange(positions.shape[-1], device=positions.device) < lengths.unsqueeze(-1)
        newest = torch.where(valid, positions, -1).amax(-1, keepdim=True)  # (B, H, 1)
        head = torch.arange(lengths.shape[1], device=positions.device).view(1, -1, 1)
        mask = (uniform_draws(key, head, positions.gather(2, evicted), newest) < prob).float()
    share = mask / merge_tokens  # m_e / n, (B, H, 1)
    width = values.shape[-1]
    x_e = values.gather(2, evicted.unsqueeze(-1).expand(-1, -1, 1, width)).float()  # earlier merges included
    at_targets = targets.unsqueeze(-1).expand(-1, -1, -1, width)
    received = values.gather(2, at_targets).float()
    received = torch.where(real.unsqueeze(-1), received + x_e * share.unsqueeze(-1), received)
    values.scatter_(2, at_targets, received.to(values.dtype))
    move_last_into(victim, lengths, keys, values, positions, state)
