"""A pass's attention accumulated into per-slot state in place, with the number of queries that saw each slot.

Methods that average a slot's attention over the queries that could see it (WeightedKV; H2O's
``mean_over_observers``) keep a += the pass's summed attention and n += its observers per slot. At every
decode step that is two (B, H, C) updates; the torch reference takes a dozen small operations, the Triton twin
(``triton_observe``, same signature, see ``dispatch``) two launches over blocks of the rows.

Shapes: accumulated, observed, attention, positions (B, H, C); lengths (B, H) long; num_queries (B,) or None
(one query).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvbench.kernels.dispatch import use_triton


def pass_observers(positions: Tensor, lengths: Tensor, num_queries: Tensor | None) -> Tensor:
    """(B, H, C) float: how many queries of the last pass could attend each slot, after the pass appended its
    tokens: ``num_queries`` for the older slots, ``q - i`` for the pass's i-th new token (causal), 0 on padding.

    A pass of q tokens counts as q observations, as q one-token steps would; ``num_queries=None`` counts as one
    query."""
    valid = torch.arange(positions.shape[-1], device=positions.device) < lengths.unsqueeze(-1)
    newest = positions.masked_fill(~valid, -1).amax(-1, keepdim=True)  # (B, H, 1) the pass's last token
    seen = (newest - positions + 1).clamp(min=0)
    # one query: a clamp, not a host scalar copied to the device (a copy a CUDA graph capture refuses)
    seen = seen.clamp(max=1) if num_queries is None else torch.minimum(seen, num_queries.to(positions).view(-1, 1, 1))
    return seen.masked_fill(~valid, 0).float()


def observe_pass(accumulated: Tensor, observed: Tensor, attention: Tensor, positions: Tensor, lengths: Tensor,
                 num_queries: Tensor | None) -> None:
    """accumulated += attention; observed += ``pass_observers``, in place."""
    if use_triton("observe_pass", attention):
        from kvbench.kernels import triton_observe

        return triton_observe.observe_pass(accumulated, observed, attention, positions, lengths, num_queries)
    accumulated.add_(attention)
    observed.add_(pass_observers(positions, lengths, num_queries))
