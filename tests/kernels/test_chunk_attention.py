"""The chunked-prefill attention (``chunk_attention``): its torch reference against the positional masking
rule of ``ragged_attention`` (cached slots in any order at any earlier position), and the Triton kernel against
the reference on odd shapes: one query, one slot, no cached slot, lengths off the tile edges, ragged heads,
GQA groups of 3, head sizes that are not powers of two, a per-slot logit bias."""

from __future__ import annotations

import pytest
import torch

from kvbench.kernels import triton_chunk
from kvbench.kernels.attention_stats import ragged_attention
from kvbench.kernels.chunk_attention import chunk_attention
from kvbench.kernels.column_sums import attention_lse
from kvbench.kernels.dispatch import use_backend

# (B, H_q, H_kv, q, C, D)
SHAPES = {
    "one_slot": (1, 1, 1, 1, 1, 16),
    "one_query": (2, 4, 2, 1, 50, 16),
    "gqa3_ragged": (2, 6, 2, 21, 77, 24),
    "chunk_over_cache": (1, 8, 2, 40, 130, 32),
}


def chunk_case(shape, dtype, bias: bool, seed=0):
    """Storage whose row (b, h) holds a ragged number of cached slots (0 in one row) then the q new ones."""
    B, Hq, Hkv, Q, C, D = shape
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(B, Hq, Q, D, generator=g).to(dtype)
    keys = torch.randn(B, Hkv, C, D, generator=g).to(dtype)
    values = torch.randn(B, Hkv, C, D, generator=g).to(dtype)
    cached = torch.randint(0, C - Q + 1, (B, Hkv), generator=g)
    cached[0, 0] = C - Q  # a full row, and (with B > 1) an empty cache
    if B > 1:
        cached[1, -1] = 0
    key_bias = torch.randn(B, Hkv, C, generator=g) if bias else None
    return query, keys, values, cached + Q, key_bias


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_reference_is_ragged_attention_with_the_cached_slots_first(shape, bias):
    query, keys, values, lengths, key_bias = chunk_case(shape, torch.float32, bias)
    B, _, Hkv, Q, C, _ = shape
    g = torch.Generator().manual_seed(1)
    start = 1000  # the pass's first position; cached slots hold shuffled earlier positions
    positions = torch.full((B, Hkv, C), -1)
    for b in range(B):
        for h in range(Hkv):
            n = int(lengths[b, h]) - Q
            positions[b, h, :n] = torch.randperm(start, generator=g)[:n]
            positions[b, h, n:n + Q] = torch.arange(start, start + Q)
    query_pos = torch.arange(start, start + Q).expand(B, Q)
    valid = torch.arange(C).view(1, 1, C) < lengths.unsqueeze(-1)
    with use_backend("torch"):
        out, lse = chunk_attention(query, keys, values, lengths, 0.3, key_bias)
        want, _ = ragged_attention(query, keys, values, valid, positions, query_pos, 0.3, key_bias=key_bias)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        if not bias:
            _, want_lse = attention_lse(query, keys, None, valid, positions, query_pos, 0.3)
            torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_triton_matches_reference(shape, bias, dtype, output_tolerance):
    query, keys, values, lengths, key_bias = chunk_case(shape, dtype, bias)
    with use_backend("torch"):
        out_ref, lse_ref = chunk_attention(query, keys, values, lengths, 0.3, key_bias)
    out, lse = triton_chunk.chunk_attention(query, keys, values, lengths, 0.3, key_bias)
    assert out.dtype == dtype and out.shape == out_ref.shape
    torch.testing.assert_close(out.float(), out_ref.float(), **output_tolerance)
    torch.testing.assert_close(lse, lse_ref, atol=1e-4, rtol=1e-5)
    assert out.transpose(1, 2).is_contiguous()  # the layout the output projection reads: no copy


@pytest.mark.parametrize("method", ["full", "h2o"])
def test_chunked_prefill_same_with_either_backend(tiny_model, method):
    """Through the engine: chunks of 16 over a 45-token prompt (the later chunks take the chunk path; H2O's
    column sums come from its lse)."""
    from kvbench.budget import Budget
    from kvbench.engine import Engine
    from kvbench.kernels import dispatch
    from kvbench.methods.full import Full
    from kvbench.methods.h2o import H2O

    compress, budget = (Full(), Budget("fraction", 1.0)) if method == "full" else (H2O(), Budget("tokens", 20))
    prompt = torch.randint(3, tiny_model.config.vocab_size, (45,), generator=torch.Generator().manual_seed(5)).tolist()
    runs = {}
    for backend in ("torch", "triton"):
        dispatch.ran.clear()
        with use_backend(backend):
            # not compiled: under this folder's CUDA mode torch.Generator is a function, which inductor's
            # isinstance checks refuse; the chunk path is what this compares
            engine = Engine(tiny_model, compress, budget, prefill_chunk_size=16, compile=False)
            runs[backend] = engine.generate([prompt], max_new_tokens=4, stop_token_ids=set())[0]
        assert dispatch.ran["chunk_attention"] == backend
    assert runs["triton"].tokens == runs["torch"].tokens
    assert runs["triton"].kept_per_layer_head == runs["torch"].kept_per_layer_head
