"""Attention of a pass's q new tokens (a prompt chunk, a suffix, a teacher-forced chunk) over a cache that
already holds the earlier tokens: the flash-style pass of chunked prefill.

Row ``(b, h)`` of the storage holds ``lengths[b, h]`` real slots (ragged per row and head); the pass wrote
its q tokens, in order, into each row's last q real slots (``LayerKV.write``), and every slot before them
holds an earlier token (any stored positions, any order: in-place eviction moves slots). So query i sees
every cached slot and the pass's own slots up to its own: slot s is visible iff
``s <= lengths[b, h] - q + i`` (the causal rule with the offset of the cached slots), and no position is
read. An optional per-slot logit bias (``kv.LOGIT_BIAS``) is added to every logit of its slot.

The log-sum-exp comes back with the output, so the column-sum statistics follow from
``column_sums.column_sums_from_lse`` as in the unchunked prompt pass. This is the float32 torch reference,
chunked over queries (memory O(chunk * C)); ``triton_chunk`` holds the kernel of the same signature.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvbench.kernels.dispatch import use_triton


def chunk_attention(
    query: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, scaling: float, key_bias: Tensor | None = None,
    chunk: int = 512,
) -> tuple[Tensor, Tensor]:
    """query (B, H_q, q, D); keys/values (B, H_kv, C, D) with H_q a multiple of H_kv; lengths (B, H_kv) real
    slots per row, the pass's q tokens included (lengths >= q); key_bias: optional (B, H_kv, C).

    Returns (output (B, H_q, q, D_v) in query's dtype, lse (B, H_q, q) float32, natural log).
    """
    if use_triton("chunk_attention", query):
        from kvbench.kernels import triton_chunk

        return triton_chunk.chunk_attention(query, keys, values, lengths, scaling, key_bias, chunk)
    B, Hq, Q, _ = query.shape
    group, C = Hq // keys.shape[1], keys.shape[2]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    bias = None if key_bias is None else key_bias.float().repeat_interleave(group, dim=1).unsqueeze(2)
    last_cached = (lengths - Q).repeat_interleave(group, dim=1).view(B, Hq, 1, 1)  # query i sees s <= this + i
    slots = torch.arange(C, device=query.device)
    out = query.new_empty(B, Hq, Q, values.shape[-1])
    lse = query.new_empty(B, Hq, Q, dtype=torch.float32)
    for start in range(0, Q, chunk):
        stop = min(Q, start + chunk)
        logits = torch.matmul(query[:, :, start:stop].float(), k.transpose(-1, -2)) * scaling  # (B, H_q, c, C)
        if bias is not None:
            logits = logits + bias
        rows = torch.arange(start, stop, device=query.device).view(1, 1, -1, 1)
        logits = logits.masked_fill(slots.view(1, 1, 1, C) > last_cached + rows, float("-inf"))
        lse[:, :, start:stop] = torch.logsumexp(logits, dim=-1)
        out[:, :, start:stop] = torch.matmul(torch.softmax(logits, dim=-1), v).to(out.dtype)
    return out, lse
