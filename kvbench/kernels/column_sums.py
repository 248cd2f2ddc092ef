"""Attention statistics from the forward pass's log-sum-exp, never materialising the (queries x keys) matrix.

EMS [App. A] computes column sums of the softmax attention inside a FlashAttention-style kernel: the forward
pass already knows each query's log-sum-exp ``lse_i = log sum_j exp(s_ij)``, so ``A_ij = exp(s_ij - lse_i)``
can be recomputed tile by tile and summed over queries (the loop order swapped: keys outside, queries
inside), exactly equal to summing the rows of the softmax. These are the float32 torch references, chunked
over queries (memory O(chunk * T)); ``triton_attention`` holds the kernels of the same signatures.

Masking is ``attention_stats.attention_mask``: query i sees slot s iff the slot is real and its original
position is <= the query's; padding queries (position < 0) have lse = -inf and contribute nothing.
Shapes: query (B, H_q, Q, D); keys/values (B, H_kv, T, D) with H_q a multiple of H_kv (GQA);
key_valid/key_pos (B, H_kv, T); query_pos (B, Q); lse (B, H_q, Q) float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvbench.kernels.attention_stats import chunk_logits, window_queries
from kvbench.kernels.dispatch import use_triton


def causal_attention_lse(query: Tensor, keys: Tensor, values: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    """The prompt pass's causal self-attention and its log-sum-exp, in one pass.

    query (B, H_q, Q, D); keys/values (B, H_kv, Q, D), the same Q tokens, unpadded. Returns the output
    (B, H_q, Q, D_v) in query's dtype and lse (B, H_q, Q) float32 (natural log). The fused kernels PyTorch
    ships compute the lse anyway and return it: on CUDA cuDNN's (as fast as the sdpa the full cache runs;
    FlashAttention's where cuDNN refuses the inputs), on the CPU the kernel ``scaled_dot_product_attention``
    itself runs, so the output is bit-identical to the wrapped sdpa's. A float32 CUDA prompt, which neither
    takes, goes through ``attention_lse``.
    """
    B, Hq, Q, _ = query.shape
    group = Hq // keys.shape[1]
    if query.is_cuda and query.dtype == torch.float32:
        pos = torch.arange(Q, device=query.device).expand(B, Q)
        key_pos = pos.unsqueeze(1).expand(-1, keys.shape[1], -1)
        return attention_lse(query, keys, values, torch.ones_like(key_pos, dtype=torch.bool), key_pos, pos, scaling)
    k = keys.repeat_interleave(group, dim=1) if group > 1 else keys
    v = values.repeat_interleave(group, dim=1) if group > 1 else values
    if not query.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, k, v, 0.0, True, scale=scaling)
        return out, lse.float()
    try:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(query, k, v, None, True, 0.0, True, False,
                                                                        scale=scaling)[:2]
    except RuntimeError:  # no cuDNN attention for these inputs or this GPU
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(query, k, v, 0.0, True, False,
                                                                        scale=scaling)[:2]
    return out, lse.reshape(B, Hq, Q).float()


def attention_lse(
    query: Tensor, keys: Tensor, values: Tensor | None, key_valid: Tensor, key_pos: Tensor, query_pos: Tensor,
    scaling: float, chunk: int = 512,
) -> tuple[Tensor | None, Tensor]:
    """Masked attention output (B, H_q, Q, D_v) in query's dtype (None without values) and lse (B, H_q, Q).

    Queries that see no slot (padding) get output 0 and lse -inf.
    """
    if use_triton("attention_lse", query):
        from kvbench.kernels import triton_attention

        return triton_attention.attention_lse(query, keys, values, key_valid, key_pos, query_pos, scaling, chunk)
    B, Hq, Q, _ = query.shape
    group = Hq // keys.shape[1]
    out = None if values is None else query.new_empty(B, Hq, Q, values.shape[-1])
    lse = query.new_empty(B, Hq, Q, dtype=torch.float32)
    k_rep = keys.float().repeat_interleave(group, dim=1)
    v_rep = None if values is None else values.float().repeat_interleave(group, dim=1)
    for start in range(0, Q, chunk):
        stop = min(Q, start + chunk)
        logits = chunk_logits(query, k_rep, key_valid, key_pos, query_pos, scaling, start, stop)
        lse[:, :, start:stop] = torch.logsumexp(logits, dim=-1)
        if out is not None:
            probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
            out[:, :, start:stop] = torch.matmul(probs, v_rep).to(out.dtype)
    return out, lse


def column_sums_from_lse(
    query: Tensor, keys: Tensor, lse: Tensor, key_valid: Tensor, key_pos: Tensor, query_pos: Tensor,
    scaling: float, window: int = 0, chunk: int = 512,
) -> tuple[Tensor, Tensor | None]:
    """Column sums of the softmax attention, recomputed from Q, K and the forward's lse.

    Returns (column_sums, window_column_sums), each (B, H_kv, T) float32 averaged over the query heads of a
    GQA group: the sum over all queries, and over the last ``window`` queries (None when window == 0).
    """
    if use_triton("column_sums_from_lse", query):
        from kvbench.kernels import triton_attention

        return triton_attention.column_sums_from_lse(
            query, keys, lse, key_valid, key_pos, query_pos, scaling, window, chunk
        )
    B, Hq, Q, _ = query.shape
    Hkv, T = keys.shape[1], keys.shape[2]
    group = Hq // Hkv
    in_window = window_queries(query_pos, window)
    k_rep = keys.float().repeat_interleave(group, dim=1)
    col = query.new_zeros(B, Hkv, T, dtype=torch.float32)
    win = query.new_zeros(B, Hkv, T, dtype=torch.float32) if window > 0 else None
    for start in range(0, Q, chunk):
        stop = min(Q, start + chunk)
        logits = chunk_logits(query, k_rep, key_valid, key_pos, query_pos, scaling, start, stop)
        probs = torch.exp(logits - lse[:, :, start:stop, None]).nan_to_num(0.0)  # padding: -inf - -inf
        grouped = probs.view(B, Hkv, group, stop - start, T).mean(2)  # (B, Hkv, c, T)
        col += grouped.sum(2)
        if win is not None:
            win += (grouped * in_window[:, start:stop].view(B, 1, -1, 1)).sum(2)
    return col, win
