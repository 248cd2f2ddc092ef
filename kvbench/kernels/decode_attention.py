"""Attention of one decode query per row over a static-capacity ragged cache, with the step statistics.

Row ``(b, h)`` of the cache holds ``lengths[b, h]`` real slots at indices ``[0, lengths)``, in any order
(in-place decode compression moves slots); every real slot is visible to the new token. Only the first
``span`` slots are read: the host passes the longest row it knows of, or the whole capacity while a CUDA
graph is captured (shapes must not depend on lengths then). Statistics come back aligned with the whole
storage (capacity slots, zeros past each row's length), as ``AttentionStats`` promises methods.

Torch reference: ``attention_stats.ragged_attention`` over the span, so both decode paths share one masking
rule; ``triton_decode`` holds the split-K (flash-decoding) kernel of the same signature.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from kvbench.kernels.attention_stats import pending_step, ragged_attention
from kvbench.kernels.dispatch import use_triton


def decode_attention(
    query: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, positions: Tensor, query_pos: Tensor,
    scaling: float, span: int, want_step: bool = False, key_bias: Tensor | None = None, defer_step: bool = False,
) -> tuple[Tensor, Tensor | Callable[..., Tensor] | None]:
    """query (B, H_q, 1, D); keys/values (B, H_kv, C, D); lengths (B, H_kv); positions (B, H_kv, C) and
    query_pos (B, 1): original indices; key_bias: optional (B, H_kv, C) per-slot logit bias.

    Returns (output (B, H_q, 1, D_v) in query's dtype, step attention (B, H_kv, C) float32 averaged over the
    query heads of a group, or None unless ``want_step``). ``defer_step``: the step attention as a callable that
    computes it, or with ``into=`` adds it to a float32 tensor (``AttentionStats.pending_step``; the Triton twin
    launches its last kernel there).
    """
    if use_triton("decode_attention", query):
        from kvbench.kernels import triton_decode

        return triton_decode.decode_attention(query, keys, values, lengths, positions, query_pos, scaling, span,
                                              want_step, key_bias, defer_step)
    valid = torch.arange(span, device=keys.device).view(1, 1, -1) < lengths.unsqueeze(-1)
    bias = None if key_bias is None else key_bias[:, :, :span]
    out, stats = ragged_attention(query, keys[:, :, :span], values[:, :, :span], valid, positions[:, :, :span],
                                  query_pos, scaling, want_step=want_step, key_bias=bias)
    step = stats.get("step_attention")
    if step is not None:
        step = F.pad(step, (0, keys.shape[2] - span))
    return out, pending_step(step) if defer_step and step is not None else step
