"""Attention over ragged per-head caches, and the attention statistics methods declare, chunk by chunk.

Never materialises the (queries x keys) matrix of a whole prompt: queries are processed in chunks of
``chunk`` rows, so memory is O(chunk * T) per head while column sums accumulate exactly.

Masking rule (the same for prefill, suffix chunks and decode): query i of sample b attends to slot s of
head h iff the slot is real and its original position is <= the query's position. Padding queries
(position < 0) produce zero output and contribute nothing to the statistics.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kvbench.kernels.dispatch import use_triton


def attention_mask(key_valid: Tensor, key_pos: Tensor, query_pos: Tensor) -> Tensor:
    """(B, H_kv, Q, T) bool from key_valid/key_pos (B, H_kv, T) and query_pos (B, Q)."""
    q = query_pos.view(query_pos.shape[0], 1, -1, 1)
    key_ok = (key_valid & (key_pos >= 0)).unsqueeze(2)  # padding keys (position -1) are never attended
    return key_ok & (key_pos.unsqueeze(2) <= q) & (q >= 0)


def window_queries(query_pos: Tensor, window: int) -> Tensor:
    """(B, Q) bool: the last ``window`` queries of the pass (padding is on the left, so these are the newest;
    padding queries among them attend to nothing and so add nothing)."""
    Q = query_pos.shape[1]
    return (torch.arange(Q, device=query_pos.device) >= Q - window).view(1, Q).expand_as(query_pos)


def pending_step(step: Tensor) -> Callable[..., Tensor]:
    """A step attention already made, as ``AttentionStats.pending_step`` takes it (``defer_step``): called, it
    returns the step; with ``into=``, it adds the step to that float32 tensor in place and returns it."""
    return lambda into=None: step if into is None else into.add_(step)


def per_kv_head(a: Tensor, b: Tensor) -> Tensor:
    """(B, H_q, c, X) @ (B, H, X, Y) -> (B, H_q, c, Y): with H = H_kv < H_q, query head hq against KV head
    hq // group (GQA), one matmul per member of a group over every KV head at once, without repeating K or V to
    the query heads; with H = H_q, the plain product. For one query row (c = 1: a decode step) each head's
    product has the bits of the product over K or V repeated (a test checks it; so did 768 shapes on one and two
    threads). Several rows need not: with one KV head the BLAS splits a lone product over its threads and sums it
    in another order, so passes of several queries repeat K and V. On the CPU, a decode step's attention of 9
    query heads over 3 x 989 slots took 183 us without the copies, against 240-500 us with them."""
    B, Hq, c, X = a.shape
    Hkv = b.shape[1]
    if Hq == Hkv:
        return torch.matmul(a, b)
    members = a.unflatten(1, (Hkv, Hq // Hkv))
    return torch.stack([torch.matmul(members[:, :, i], b) for i in range(Hq // Hkv)], 2).flatten(1, 2)


def chunk_logits(
    query: Tensor, keys: Tensor, key_valid: Tensor, key_pos: Tensor, query_pos: Tensor, scaling: float,
    start: int, stop: int, bias: Tensor | None = None,
) -> Tensor:
    """(B, H_q, c, T) float32 logits of queries [start, stop); -inf where masked.

    keys: (B, H_kv, T, D) or, repeated to the query heads, (B, H_q, T, D), float32 (``per_kv_head``); bias:
    optional (B, H_q, 1, T) per-slot logit bias."""
    Hkv = key_valid.shape[1]
    mask = attention_mask(key_valid, key_pos, query_pos[:, start:stop]).unsqueeze(2)  # (B, H_kv, 1, c, T)
    logits = per_kv_head(query[:, :, start:stop].float(), keys.transpose(-1, -2)) * scaling
    if bias is not None:
        logits = logits + bias
    return logits.unflatten(1, (Hkv, -1)).masked_fill(~mask, float("-inf")).flatten(1, 2)


def ragged_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor | None,
    key_valid: Tensor,
    key_pos: Tensor,
    query_pos: Tensor,
    scaling: float,
    window: int = 0,
    want_column_sums: bool = False,
    want_step: bool = False,
    chunk: int = 512,
    key_bias: Tensor | None = None,
    want_query_column_sums: bool = False,
) -> tuple[Tensor | None, dict[str, Tensor]]:
    """Masked softmax attention with optional statistics.

    query: (B, H_q, Q, D); keys/values: (B, H_kv, T, D); H_q a multiple of H_kv (GQA groups).
    Returns (output (B, H_q, Q, D) or None when values is None, stats) where stats may hold
    "column_sums", "window_column_sums" (over the last ``window`` real queries) and "step_attention"
    (attention of this pass's queries: the new token's at a decode step, summed over the pass's real
    queries when several are fed at once), each (B, H_kv, T), averaged over the query heads of a group,
    in float32; and "query_column_sums" (B, H_q, T), the column sums of every query head, not averaged.
    """
    if key_bias is None and not want_query_column_sums and use_triton("ragged_attention", query):
        # the Triton twin takes no bias and gives no per-query-head sums yet
        from kvbench.kernels import triton_attention

        return triton_attention.ragged_attention(
            query, keys, values, key_valid, key_pos, query_pos, scaling, window, want_column_sums, want_step, chunk
        )
    B, Hq, Q, D = query.shape
    Hkv, T = keys.shape[1], keys.shape[2]
    group = Hq // Hkv
    in_window = window_queries(query_pos, window)
    out = None if values is None else query.new_empty(B, Hq, Q, values.shape[-1])
    col = query.new_zeros(B, Hkv, T, dtype=torch.float32) if want_column_sums or want_step else None
    win = query.new_zeros(B, Hkv, T, dtype=torch.float32) if window > 0 else None
    qcol = query.new_zeros(B, Hq, T, dtype=torch.float32) if want_query_column_sums else None
    keys = keys.float()
    values = None if values is None else values.float()
    if Q > 1:  # K and V repeated to the query heads once for every chunk; one query (a decode step) needs no copy
        keys = keys.repeat_interleave(group, dim=1)  # (``per_kv_head``: several rows' bits need the repeat)
        values = None if values is None else values.repeat_interleave(group, dim=1)
    bias = None if key_bias is None else key_bias.float().repeat_interleave(group, dim=1)[:, :, None, :T]
    for start in range(0, Q, chunk):
        stop = min(Q, start + chunk)
        logits = chunk_logits(query, keys, key_valid, key_pos, query_pos, scaling, start, stop, bias)
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # fully masked (padding) queries -> 0
        if out is not None:
            out[:, :, start:stop] = per_kv_head(probs, values).to(out.dtype)
        if qcol is not None:
            qcol += probs.sum(2)
        grouped = probs.view(B, Hkv, group, stop - start, T).mean(2)  # (B, Hkv, c, T)
        if col is not None:
            col += grouped.sum(2)
        if win is not None:
            win += (grouped * in_window[:, start:stop].view(B, 1, -1, 1)).sum(2)
    stats: dict[str, Tensor] = {}
    if want_column_sums:
        stats["column_sums"] = col
    if want_step:
        stats["step_attention"] = col
    if win is not None:
        stats["window_column_sums"] = win
    if qcol is not None:
        stats["query_column_sums"] = qcol
    return out, stats
