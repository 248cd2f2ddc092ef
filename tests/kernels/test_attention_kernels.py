"""Triton attention kernels (forward with lse, EMS column sums, ragged_attention) against the torch references.

Shapes cover length 1, lengths that are not multiples of the 64-slot tiles, GQA, decode (one query) and
prefill (as many queries as keys), ragged rows (an empty one included), left-padded queries and large logits.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvbench.kernels import column_sums, triton_attention
from kvbench.kernels.attention_stats import per_kv_head, ragged_attention
from kvbench.kernels.dispatch import use_backend
from tests.kernels.conftest import MODE

# (B, H_q, H_kv, Q, T, D)
SHAPES = {
    "length1": (1, 1, 1, 1, 1, 16),
    "gqa_decode": (2, 8, 2, 1, 77, 64),
    "gqa_chunk": (2, 4, 2, 21, 77, 24),
    "prefill": (1, 2, 1, 70, 70, 8),
}


def ragged_case(shape, dtype, logit_scale=1.0, seed=0):
    """Random inputs; batch row 1 has ragged per-head lengths (one head empty) and left-padded queries."""
    B, Hq, Hkv, Q, T, D = shape
    g = torch.Generator().manual_seed(seed)
    query = (torch.randn(B, Hq, Q, D, generator=g) * logit_scale).to(dtype)
    keys = torch.randn(B, Hkv, T, D, generator=g).to(dtype)
    values = torch.randn(B, Hkv, T, D, generator=g).to(dtype)
    lengths = torch.full((B, Hkv), T)
    query_pos = torch.arange(T - Q, T).repeat(B, 1)
    if B > 1:
        lengths[1] = torch.linspace(0, T, Hkv).long()
        query_pos[1, : Q // 3] = -1
    key_valid = torch.arange(T).view(1, 1, T) < lengths.unsqueeze(-1)
    key_pos = torch.arange(T).repeat(B, Hkv, 1)
    return query, keys, values, key_valid, key_pos, query_pos


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_attention_lse_matches_reference(shape, dtype, output_tolerance):
    query, keys, values, key_valid, key_pos, query_pos = ragged_case(shape, dtype)
    out_ref, lse_ref = column_sums.attention_lse(query, keys, values, key_valid, key_pos, query_pos, 0.3)
    out, lse = triton_attention.attention_lse(query, keys, values, key_valid, key_pos, query_pos, 0.3)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), out_ref.float(), **output_tolerance)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))  # queries that see nothing: -inf in both
    torch.testing.assert_close(lse.nan_to_num(0, 0, 0), lse_ref.nan_to_num(0, 0, 0), atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_column_sums_match_reference_and_conserve_mass(shape, dtype):
    query, keys, values, key_valid, key_pos, query_pos = ragged_case(shape, dtype)
    _, lse = column_sums.attention_lse(query, keys, None, key_valid, key_pos, query_pos, 0.3)
    args = (query, keys, lse, key_valid, key_pos, query_pos, 0.3)
    col_ref, win_ref = column_sums.column_sums_from_lse(*args, window=5)
    col, win = triton_attention.column_sums_from_lse(*args, window=5)
    # float32 statistics whatever the input dtype: the error grows with the number of summed queries
    torch.testing.assert_close(col, col_ref, atol=1e-6 * shape[3], rtol=1e-5)
    torch.testing.assert_close(win, win_ref, atol=1e-6 * 5, rtol=1e-5)
    # every real query that sees a slot spreads exactly one unit of attention over the slots
    seeing = ((query_pos >= 0).unsqueeze(1) & key_valid.any(-1, keepdim=True)).sum(-1).float()  # (B, H_kv)
    torch.testing.assert_close(col.sum(-1), seeing, atol=1e-4, rtol=0)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_ragged_attention_same_with_either_backend(shape):
    """The composition (forward, column sums, step attention); other dtypes are covered kernel by kernel."""
    query, keys, values, key_valid, key_pos, query_pos = ragged_case(shape, torch.float32, logit_scale=8.0)
    args = (query, keys, values, key_valid, key_pos, query_pos, 0.5)
    kwargs = dict(window=4, want_column_sums=True, want_step=True)
    with use_backend("torch"):
        out_ref, stats_ref = ragged_attention(*args, **kwargs)
    with use_backend("triton"):
        out, stats = ragged_attention(*args, **kwargs)
    # logits reach ~100 (scale 8): fp32 sums in another order differ by up to ~1.4e-5 on a GPU (seen on H200)
    torch.testing.assert_close(out, out_ref, atol=5e-5, rtol=1e-5)
    assert stats.keys() == stats_ref.keys() == {"column_sums", "window_column_sums", "step_attention"}
    for name, ref in stats_ref.items():
        torch.testing.assert_close(stats[name], ref, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_column_sums_hand_computed(backend):
    """Two identical keys seen causally by two queries: A = [[1, 0], [1/2, 1/2]] in both heads of the group."""
    query = torch.ones(1, 2, 2, 16)
    keys = torch.ones(1, 1, 2, 16)
    key_pos, key_valid = torch.tensor([[[0, 1]]]), torch.ones(1, 1, 2, dtype=torch.bool)
    query_pos = torch.tensor([[0, 1]])
    with use_backend(backend):
        out, lse = column_sums.attention_lse(query, keys, None, key_valid, key_pos, query_pos, 0.25)
        col, win = column_sums.column_sums_from_lse(query, keys, lse, key_valid, key_pos, query_pos, 0.25, 1)
    assert out is None
    torch.testing.assert_close(lse, torch.tensor([4.0, 4.0 + math.log(2)]).expand(1, 2, 2))
    torch.testing.assert_close(col, torch.tensor([[[1.5, 0.5]]]))
    torch.testing.assert_close(win, torch.tensor([[[0.5, 0.5]]]))


# (B, H_q, H_kv, capacity, D, span): decode over static-capacity storage; span < capacity as in eager decoding
DECODE_SHAPES = {
    "gqa": (2, 8, 2, 77, 64, 77),
    "span_below_capacity": (3, 6, 2, 300, 32, 250),
    "mha_short": (1, 4, 4, 5, 16, 5),
    "many_splits": (1, 4, 1, 2000, 16, 1999),
}


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "logit_bias"])
@pytest.mark.parametrize("shape", DECODE_SHAPES.values(), ids=DECODE_SHAPES.keys())
def test_decode_attention_matches_reference(shape, bias, dtype, output_tolerance):
    from kvbench.kernels import triton_decode
    from kvbench.kernels.decode_attention import decode_attention

    B, Hq, Hkv, C, D, span = shape
    g = torch.Generator().manual_seed(3)
    query = torch.randn(B, Hq, 1, D, generator=g).to(dtype)
    keys, values = (torch.randn(B, Hkv, C, D, generator=g).to(dtype) for _ in range(2))
    lengths = torch.randint(1, span + 1, (B, Hkv), generator=g)
    lengths[0, 0] = span
    if B > 1:
        lengths[-1, -1] = 0  # an empty row sees nothing: output 0, step attention 0
    positions = torch.arange(C).repeat(B, Hkv, 1)
    query_pos = torch.full((B, 1), C)
    key_bias = torch.randn(B, Hkv, C, generator=g) if bias else None
    args = (query, keys, values, lengths, positions, query_pos, 0.3, span, True, key_bias)
    with use_backend("torch"):
        out_ref, step_ref = decode_attention(*args)
    out, step = triton_decode.decode_attention(*args)
    assert out.dtype == dtype and step.shape == (B, Hkv, C)
    torch.testing.assert_close(out.float(), out_ref.float(), **output_tolerance)
    torch.testing.assert_close(step, step_ref, atol=1e-5, rtol=1e-4)
    seeing = (lengths > 0).float()  # each real query spreads one unit of attention over the slots it sees
    torch.testing.assert_close(step.sum(-1), seeing, atol=1e-4, rtol=0)
    assert not step[..., span:].any()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_attention_deferred_step_is_the_step(backend):
    """``defer_step`` returns the output at once and the step attention as a callable (a decode step runs it on
    the layer's side stream): the same tensors, bit for bit, as the step made at once."""
    from kvbench.kernels.decode_attention import decode_attention

    B, Hq, Hkv, C, D, span = DECODE_SHAPES["gqa"]
    g = torch.Generator().manual_seed(4)
    query = torch.randn(B, Hq, 1, D, generator=g)
    keys, values = (torch.randn(B, Hkv, C, D, generator=g) for _ in range(2))
    lengths = torch.randint(1, span + 1, (B, Hkv), generator=g)
    args = (query, keys, values, lengths, torch.arange(C).repeat(B, Hkv, 1), torch.full((B, 1), C), 0.3, span)
    with use_backend(backend):
        out, step = decode_attention(*args, want_step=True)
        deferred_out, pending = decode_attention(*args, want_step=True, defer_step=True)
        assert decode_attention(*args, defer_step=True)[1] is None
    assert callable(pending)
    assert torch.equal(deferred_out, out) and torch.equal(pending(), step)
    # into=: added to a running score in place (the Triton kernel adds where it stored), bit for bit the addition
    score = torch.rand(B, Hkv, C, generator=g)
    into = score.clone()
    assert pending(into=into) is into and torch.equal(into, score + step)
    strided = score.transpose(1, 2).contiguous().transpose(1, 2)  # not contiguous: made, then added
    assert torch.equal(pending(into=strided), score + step)


@pytest.mark.parametrize("group", [1, 2, 4, 7, 8])
def test_step_attention_is_the_torch_operations_it_replaced(group):
    """The fused step attention against the torch operations it replaced, on logits as the partials kernel
    writes them (-inf past a row's length, nothing written from ``span`` on) and every lse a row can have (an
    empty row's -inf): bit for bit compiled (libdevice's exp, the heads summed in torch's order, times float32
    1/group); the interpreter's exp is numpy's, so there to a few float32 units."""
    from kvbench.kernels import triton_decode

    B, Hkv, C, span = 2, 3, 2500, 2300
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(B, Hkv * group, C, generator=g) * 6
    lengths = torch.randint(0, span + 1, (B, Hkv * group, 1), generator=g)
    logits = torch.where(torch.arange(C) < lengths, logits, float("-inf"))
    lse = torch.logsumexp(logits[..., :span], -1)
    lse[0, :group] = float("-inf")  # an empty row: kv head 0 of row 0
    logits[0, :group] = float("-inf")
    reference = torch.exp(torch.where(torch.arange(C) < span, logits, float("-inf"))
                          - lse.nan_to_num(neginf=0.0).unsqueeze(-1)).view(B, Hkv, group, C).mean(2)
    logits[..., span:] = float("nan")  # never read
    got = triton_decode.step_attention(logits, lse, group, span)
    if MODE == "cuda":
        assert torch.equal(got, reference)
    else:
        torch.testing.assert_close(got, reference, atol=0, rtol=1e-6)
    assert not got[0, 0].any() and not got[..., span:].any()


@pytest.mark.parametrize("batch, kv_heads, group, slots, dim", [(1, 3, 3, 989, 64), (2, 1, 4, 300, 16),
                                                                (3, 8, 2, 4096, 128), (1, 1, 1, 7, 64)])
def test_per_kv_head_is_the_product_over_repeated_heads_bit_for_bit(batch, kv_heads, group, slots, dim):
    """A decode step's attention multiplies each query head by its own KV head without repeating K or V
    (``attention_stats.per_kv_head``): the logits and the output must be the products over K and V repeated to
    the query heads, bit for bit (one matmul of the group's heads together, M = group, sums in another order:
    that would move logits by units in the last place and could flip what a method evicts)."""
    g = torch.Generator().manual_seed(slots)
    query = torch.randn(batch, kv_heads * group, 1, dim, generator=g)
    keys, values = (torch.randn(batch, kv_heads, slots, dim, generator=g) for _ in range(2))
    probs = torch.softmax(torch.randn(batch, kv_heads * group, 1, slots, generator=g), -1)
    repeated = {name: t.repeat_interleave(group, dim=1) for name, t in (("keys", keys), ("values", values))}
    assert torch.equal(per_kv_head(query, keys.transpose(-1, -2)),
                       torch.matmul(query, repeated["keys"].transpose(-1, -2)))
    assert torch.equal(per_kv_head(probs, values), torch.matmul(probs, repeated["values"]))
