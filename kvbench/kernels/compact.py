"""Gather/compaction of per-head ragged caches: keep chosen slots of every row, left-aligned, padding zeroed.

The per-tensor step of ``LayerKV.gather`` (keys, values, positions and every per-slot state go through it).
Torch reference; ``triton_compact`` holds the kernel of the same signature (see ``dispatch``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvbench.kernels.dispatch import use_triton


def compact(x: Tensor, index: Tensor, lengths: Tensor, fill: float = 0) -> Tensor:
    """out[b, h, k] = x[b, h, index[b, h, k]] for k < lengths[b, h], else ``fill``.

    x: (B, H, T, D); index: (B, H, K) long slot indices (entries at or past the row's length are ignored);
    lengths: (B, H) kept slots per row. Returns (B, H, K, D) in x's dtype.
    """
    if use_triton("compact", x):
        from kvbench.kernels import triton_compact

        return triton_compact.compact(x, index, lengths, fill)
    kept = torch.arange(index.shape[-1], device=x.device).view(1, 1, -1) < lengths.unsqueeze(-1)
    idx = torch.where(kept, index, torch.zeros_like(index))
    out = x.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))
    return out.masked_fill(~kept.unsqueeze(-1), fill)
