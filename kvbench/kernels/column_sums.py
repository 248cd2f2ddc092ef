"""Attention statistics from the forward pass's log-sum-exp, never materialising the (queries x keys) matrix.

EMS [App. A] computes column sums of the softmax attention inside a FlashAttention-style kernel: the forward
pass already knows each query's log-sum-exp ``lse_i = log sum_j exp(s_ij)``, so ``A_ij = exp(s_ij - lse_i)``
can be recomputed tile by tile and summed over queries (the loop order swapped: keys outside, queries
inside), exactly equal to summing the rows of the softmax. These are the float32 torch references, chunked
over queries (memory O(chunk * T)); ``triton_attention`` holds the kernels of the same signatures.

Masking is ``attention_stats.attention_mask``: query i sees slot s iff the slot is real and its original
position is <= the query's; padding queries (position < 0) have lse = -inf and contribute nothing. The
column sums compute, per chunk, only the slots some query of the chunk sees, and mask only those that not
every query sees (``visible_span``): a prompt pass over its own keys costs the causal half of the matrix;
on the CPU such a pass takes one fused attention instead (``prompt_column_sums``).
Shapes: query (B, H_q, Q, D); keys/values (B, H_kv, T, D) with H_q a multiple of H_kv (GQA);
key_valid/key_pos (B, H_kv, T); query_pos (B, Q); lse (B, H_q, Q) float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvbench.kernels.attention_stats import attention_mask, chunk_logits
from kvbench.kernels.dispatch import use_triton


def causal_attention_lse(query: Tensor, keys: Tensor, values: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    """The prompt pass's causal self-attention and its log-sum-exp, in one pass.

    query (B, H_q, Q, D); keys/values (B, H_kv, Q, D), the same Q tokens, unpadded. Returns the output
    (B, H_q, Q, D_v) in query's dtype and lse (B, H_q, Q) float32 (natural log). The fused kernels PyTorch
    ships compute the lse anyway and return it: on CUDA cuDNN's (as fast as the sdpa the full cache runs;
    FlashAttention's where cuDNN refuses the inputs), on the CPU the kernel ``scaled_dot_product_attention``
    itself runs, so the output is bit-identical to the wrapped sdpa's. A float32 CUDA prompt, which neither
    takes, goes through ``attention_lse``.
    cuDNN and the CPU kernel take the GQA group's shared K/V heads as they are (the same bits as over keys
    repeated to every query head: ``test_causal_attention_lse_needs_no_repeated_keys``); the repeat would cost
    a copy of four times the layer's K/V (0.6 ms a layer at 32k on an H200, beside 14.4 ms of attention).
    FlashAttention's op, the fallback, gets them repeated.
    """
    B, Hq, Q, _ = query.shape
    if query.is_cuda and query.dtype == torch.float32:
        pos = torch.arange(Q, device=query.device).expand(B, Q)
        key_pos = pos.unsqueeze(1).expand(-1, keys.shape[1], -1)
        return attention_lse(query, keys, values, torch.ones_like(key_pos, dtype=torch.bool), key_pos, pos, scaling)
    if not query.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, keys, values, 0.0, True,
                                                                               scale=scaling)
        return out, lse.float()
    try:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(query, keys, values, None, True, 0.0, True,
                                                                        False, scale=scaling)[:2]
    except RuntimeError:  # no cuDNN attention for these inputs or this GPU
        group = Hq // keys.shape[1]
        k = keys.repeat_interleave(group, dim=1) if group > 1 else keys
        v = values.repeat_interleave(group, dim=1) if group > 1 else values
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
    if query.is_cuda or not is_prompt_pass(key_valid, key_pos, query_pos):
        return chunked_column_sums(query, keys, lse, key_valid, key_pos, query_pos, scaling, window, chunk)
    window_sums = None
    if window > 0:  # the window's queries alone: their column sums are the window's
        window_sums, _ = chunked_column_sums(query[:, :, -window:], keys, lse[:, :, -window:], key_valid, key_pos,
                                             query_pos[:, -window:], scaling, 0, chunk)
    return prompt_column_sums(query, keys, lse, scaling), window_sums


def is_prompt_pass(key_valid: Tensor, key_pos: Tensor, query_pos: Tensor) -> bool:
    """Whether the queries (B, Q) are the keys' own tokens, all real, in increasing positions: a prompt pass
    over its own keys, causal. Reads the answer back (a torch reference: the CPU's path)."""
    Q = query_pos.shape[1]
    return (key_pos.shape[-1] == Q and bool(key_valid.all()) and bool((query_pos >= 0).all())
            and bool((query_pos[:, 1:] > query_pos[:, :-1]).all())
            and torch.equal(key_pos, query_pos.unsqueeze(1).expand_as(key_pos)))


def prompt_column_sums(query: Tensor, keys: Tensor, lse: Tensor, scaling: float) -> Tensor:
    """Column sums of a causal prompt pass over its own keys (CPU), (B, H_kv, T) float32 averaged over each GQA
    group, from one fused attention: the sum over queries i >= j of exp(s q_i . k_j - lse_i) is the exp of the
    log-sum-exp of the swapped pass in which key j attends to the queries i >= j with those logits (lse_i
    folded in as one more dimension, both sequences reversed so that the pass is causal). The kernel
    PyTorch's CPU attention uses for the prompt does it at about the prompt attention's cost; the log-sum-exp
    round trip costs a few float32 units in the last place."""
    B, Hq, Q, _ = query.shape
    Hkv = keys.shape[1]
    group = Hq // Hkv
    attended = torch.cat([query.float() * scaling, -lse.float().unsqueeze(-1)], -1).flip(2)
    ones = keys.new_ones(B, Hkv, Q, 1, dtype=torch.float32)
    attending = torch.cat([keys.float(), ones], -1).flip(2).repeat_interleave(group, dim=1)
    _, swapped = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(attending, attended, attended, 0.0, True,
                                                                             scale=1.0)
    return swapped.float().flip(2).exp().view(B, Hkv, group, Q).mean(2)


def chunked_column_sums(
    query: Tensor, keys: Tensor, lse: Tensor, key_valid: Tensor, key_pos: Tensor, query_pos: Tensor,
    scaling: float, window: int = 0, chunk: int = 512,
) -> tuple[Tensor, Tensor | None]:
    """``column_sums_from_lse`` for any masking, ``chunk`` queries at a time (memory O(chunk x T))."""
    B, Hq, Q, D = query.shape
    Hkv, T = keys.shape[1], keys.shape[2]
    group = Hq // Hkv
    col = query.new_zeros(B, Hkv, T, dtype=torch.float32)
    win = query.new_zeros(B, Hkv, T, dtype=torch.float32) if window > 0 else None
    scaled = (query.float() * scaling).reshape(B * Hkv, group, Q, D)  # a GQA group's heads share one matmul
    keys_t = keys.float().reshape(B * Hkv, T, D).transpose(1, 2)
    neg_lse = -lse.float().reshape(B * Hkv, group, Q, 1)
    for start in range(0, Q, chunk):
        stop = min(Q, start + chunk)
        seen_by_all, seen = visible_span(key_valid, key_pos, query_pos[:, start:stop])
        if seen == 0:
            continue
        rows = (stop - start) * group
        # A = exp(s - lse), with s - lse in one GEMM; padding queries (lse -inf) are masked below
        probs = torch.baddbmm(neg_lse[:, :, start:stop].reshape(B * Hkv, rows, 1),
                              scaled[:, :, start:stop].reshape(B * Hkv, rows, D), keys_t[:, :, :seen]).exp_()
        probs = probs.view(B, Hkv, group, stop - start, seen)
        if seen_by_all < seen:  # only the slots some query of the chunk cannot see need the mask
            edge = attention_mask(key_valid[..., seen_by_all:seen], key_pos[..., seen_by_all:seen],
                                  query_pos[:, start:stop])
            probs[..., seen_by_all:].masked_fill_(~edge.unsqueeze(2), 0.0)
        col[..., :seen] += probs.sum((2, 3)) / group
        first = max(start, Q - window) if window > 0 else stop
        if first < stop:  # the window: the last ``window`` queries of the pass
            win[..., :seen] += probs[:, :, :, first - start:].sum((2, 3)) / group
    return col, win


def visible_span(key_valid: Tensor, key_pos: Tensor, query_pos: Tensor) -> tuple[int, int]:
    """(n_all, n_any): the slots [0, n_all) are real and visible to every query of ``query_pos`` (B, c) in every
    row, and no query sees a slot at or past n_any. A prompt over its own keys (causal) sees [0, its last
    query], and every query of a chunk all slots up to the chunk's first: only the diagonal block needs a mask.
    Reads two numbers back (a torch reference: the CPU's path)."""
    T = key_pos.shape[-1]
    slots = torch.arange(T, device=key_pos.device)
    everywhere = (key_valid & (key_pos <= query_pos.amin(-1).view(-1, 1, 1)) & (key_pos >= 0)).flatten(0, 1).all(0)
    somewhere = (key_valid & (key_pos <= query_pos.amax(-1).view(-1, 1, 1)) & (key_pos >= 0)).flatten(0, 1).any(0)
    n_all = int(torch.where(everywhere, T, slots).amin()) if T else 0  # the first slot not seen by all
    n_any = int(torch.where(somewhere, slots + 1, 0).amax()) if T else 0
    return min(n_all, n_any), n_any
