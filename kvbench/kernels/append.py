"""Write a pass's q new tokens after each row's last real slot, in place: the cache write of every pass
whose rows differ in length (and of every CUDA-graph-captured decode step, whose lengths only the device
knows).

Row ``(b, h)`` gets the new keys, values and positions at slots ``[lengths, lengths + q)``; every per-slot
state there starts at 0; the row grows by q. Nothing is read back to the host. This is the torch reference
(a handful of scatters); ``triton_append`` does it in one launch.

Shapes: new_keys (B, H, q, D), new_values (B, H, q, D_v), new_positions (B, q); lengths (B, H) long;
keys (B, H, C, D), values (B, H, C, D_v), positions (B, H, C); state (S, B, H, C) float32 (the layer's
stacked per-slot states; S may be 0). The caller guarantees room: C >= every length + q.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvbench.kernels.dispatch import use_triton


def append_slots(new_keys: Tensor, new_values: Tensor, new_positions: Tensor, lengths: Tensor, keys: Tensor,
                 values: Tensor, positions: Tensor, state: Tensor) -> None:
    if use_triton("append_slots", keys):
        from kvbench.kernels import triton_append

        return triton_append.append_slots(new_keys, new_values, new_positions, lengths, keys, values, positions,
                                          state)
    B, H, q, _ = new_keys.shape
    slot = lengths.unsqueeze(-1) + torch.arange(q, device=keys.device)  # (B, H, q)
    keys.scatter_(2, slot.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]), new_keys.to(keys.dtype))
    values.scatter_(2, slot.unsqueeze(-1).expand(-1, -1, -1, values.shape[-1]), new_values.to(values.dtype))
    positions.scatter_(2, slot, new_positions.view(B, 1, q).expand(B, H, q))
    if state.shape[0]:
        state.scatter_(3, slot.expand(state.shape[0], *slot.shape), 0.0)
    lengths += q
