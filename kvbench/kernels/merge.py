"""Segment-weighted merge: many slots -> one slot per group, in one pass (KVMerger, Chelsea, D2O, CaM,
WeightedKV, EMS all reduce to it). Torch reference; ``triton_merge`` holds the kernels of the same signatures (see ``dispatch``)."""

from __future__ import annotations

import torch
from torch import Tensor

from kvbench.kernels.dispatch import use_triton


def scatter_merge(x: Tensor, target: Tensor, weight: Tensor, num_groups: int) -> Tensor:
    """out[b, h, g] = sum over slots j with target[b, h, j] == g of weight[b, h, j] * x[b, h, j].

    x: (B, H, T, D); target: (B, H, T) long in [0, num_groups) or -1 for slots that contribute nothing;
    weight: (B, H, T). Weights are used as given: callers normalise them (convex merges) themselves.
    Accumulates in float32 and returns x's dtype, shape (B, H, num_groups, D).
    """
    if use_triton("scatter_merge", x):
        from kvbench.kernels import triton_merge

        return triton_merge.scatter_merge(x, target, weight, num_groups)
    B, H, T, D = x.shape
    keep = target >= 0
    tgt = torch.where(keep, target, torch.zeros_like(target))
    w = torch.where(keep, weight.float(), torch.zeros_like(weight, dtype=torch.float32))
    out = torch.zeros(B, H, num_groups, D, dtype=torch.float32, device=x.device)
    out.scatter_add_(2, tgt.unsqueeze(-1).expand(-1, -1, -1, D), x.float() * w.unsqueeze(-1))
    return out.to(x.dtype)


def group_sum(weight: Tensor, target: Tensor, num_groups: int) -> Tensor:
    """(B, H, num_groups): sum of ``weight`` over the slots of each group (targets < 0 ignored)."""
    if use_triton("group_sum", weight):
        from kvbench.kernels import triton_merge

        return triton_merge.group_sum(weight, target, num_groups)
    keep = target >= 0
    tgt = torch.where(keep, target, torch.zeros_like(target))
    w = torch.where(keep, weight.float(), torch.zeros_like(weight, dtype=torch.float32))
    out = torch.zeros(*weight.shape[:2], num_groups, dtype=torch.float32, device=weight.device)
    return out.scatter_add_(2, tgt, w)
