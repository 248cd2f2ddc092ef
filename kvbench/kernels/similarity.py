"""Key-similarity operations on left-aligned ragged rows: adjacent cosines and runs of similar neighbours.

Used by KVMerger (merging sets = runs of consecutive similar keys). No (T x T) similarity matrix is ever
built: the chain rule needs the T-1 adjacent cosines, the anchor rule one cosine per slot. Torch references
in float32; Triton twins of the same signatures may sit beside them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def unit_keys(keys: Tensor) -> Tensor:
    """(B, H, T, D) -> float32 unit vectors; zero (padding) keys stay zero, so their cosines are 0."""
    return F.normalize(keys.float(), dim=-1, eps=1e-12)


def adjacent_cosine(keys: Tensor) -> Tensor:
    """cos(k_t, k_{t+1}) for every adjacent slot pair: keys (B, H, T, D) -> (B, H, T-1) float32."""
    unit = unit_keys(keys)
    return (unit[:, :, :-1] * unit[:, :, 1:]).sum(-1)


def run_ids(joins_next: Tensor, lengths: Tensor) -> Tensor:
    """Number the runs of each row left to right.

    joins_next: (B, H, T-1) bool, True where slot t belongs to the same run as slot t+1.
    lengths:    (B, H) real slots per row.
    Returns (B, H, T) long: run id of every real slot (0, 1, ... in positional order), -1 on padding.
    """
    B, H, n_pairs = joins_next.shape
    starts = torch.ones(B, H, n_pairs + 1, dtype=torch.long, device=joins_next.device)
    starts[..., 1:] = (~joins_next).long()
    ids = starts.cumsum(-1) - 1
    slots = torch.arange(n_pairs + 1, device=joins_next.device).view(1, 1, -1)
    return torch.where(slots < lengths.unsqueeze(-1), ids, torch.full_like(ids, -1))


def chain_runs(similarity: Tensor, mergeable: Tensor, lengths: Tensor, epsilon: float) -> Tensor:
    """Runs under the chain rule (KVMerger Algorithm 1 read literally): slots t and t+1 share a run iff both
    are mergeable and cos(k_t, k_{t+1}) > epsilon. A slot that is not mergeable is a run of its own.

    similarity: (B, H, T-1) adjacent cosines; mergeable: (B, H, T) bool; lengths: (B, H).
    Returns run ids (B, H, T) as ``run_ids``. Cost O(T).
    """
    joins = (similarity > epsilon) & mergeable[..., :-1] & mergeable[..., 1:]
    return run_ids(joins, lengths)


def anchor_runs(keys: Tensor, mergeable: Tensor, lengths: Tensor, epsilon: float) -> Tensor:
    """Runs under the anchor rule: scanning from the last slot to the first, a run starts at its right-most
    slot (the anchor) and grows left while the next slot is mergeable and cos(k_anchor, k_j) > epsilon.

    keys: (B, H, T, D); mergeable: (B, H, T) bool; lengths: (B, H).
    Returns run ids (B, H, T) as ``run_ids``. Cost O(T D), but a sequential scan of T steps over all rows.
    """
    unit = unit_keys(keys)
    B, H, T, D = unit.shape
    joins = torch.zeros(B, H, max(T - 1, 0), dtype=torch.bool, device=keys.device)
    if T < 2:
        return run_ids(joins, lengths)
    anchor = unit[:, :, T - 1]  # (B, H, D) unit key of the anchor of the run that holds slot t+1
    for t in range(T - 2, -1, -1):
        join = mergeable[:, :, t] & mergeable[:, :, t + 1] & ((anchor * unit[:, :, t]).sum(-1) > epsilon)
        joins[:, :, t] = join
        anchor = torch.where(join.unsqueeze(-1), anchor, unit[:, :, t])
    return run_ids(joins, lengths)
