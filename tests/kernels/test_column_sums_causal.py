"""The torch column sums, which compute only the slots a chunk's queries can see (and, for a prompt pass on the
CPU, take one swapped fused attention), against the previous formulation: every chunk against every key with
the full position mask."""

from __future__ import annotations

import pytest
import torch

from kvbench.kernels import column_sums
from kvbench.kernels.attention_stats import chunk_logits, window_queries
from kvbench.kernels.dispatch import use_backend
from tests.kernels.test_attention_kernels import SHAPES, ragged_case


def every_key_column_sums(query, keys, lse, key_valid, key_pos, query_pos, scaling, window=0, chunk=512):
    B, Hq, Q, _ = query.shape
    Hkv, T = keys.shape[1], keys.shape[2]
    group = Hq // Hkv
    in_window = window_queries(query_pos, window)
    k_rep = keys.float().repeat_interleave(group, dim=1)
    col = torch.zeros(B, Hkv, T)
    win = torch.zeros(B, Hkv, T)
    for start in range(0, Q, chunk):
        stop = min(Q, start + chunk)
        logits = chunk_logits(query, k_rep, key_valid, key_pos, query_pos, scaling, start, stop)
        probs = torch.exp(logits - lse[:, :, start:stop, None]).nan_to_num(0.0)
        grouped = probs.view(B, Hkv, group, stop - start, T).mean(2)
        col += grouped.sum(2)
        win += (grouped * in_window[:, start:stop].view(B, 1, -1, 1)).sum(2)
    return col, win


def prompt_case(B, Hq, Hkv, Q, D, dtype=torch.float32, seed=0):
    """A prompt pass over its own keys, as the engine's prompt attention hands it over."""
    g = torch.Generator().manual_seed(seed)
    query, keys = torch.randn(B, Hq, Q, D, generator=g).to(dtype), torch.randn(B, Hkv, Q, D, generator=g).to(dtype)
    pos = torch.arange(Q).expand(B, Q)
    return query, keys, torch.ones(B, Hkv, Q, dtype=torch.bool), pos.view(B, 1, Q).expand(B, Hkv, Q), pos


@pytest.mark.parametrize("chunk", [1, 7, 512])
@pytest.mark.parametrize("window", [0, 5, 100])
@pytest.mark.parametrize("path", ["dispatched", "chunked"])
def test_prompt_pass_matches_every_key_formulation(chunk, window, path):
    query, keys, valid, key_pos, query_pos = prompt_case(2, 6, 2, 45, 16)
    sums = column_sums.column_sums_from_lse if path == "dispatched" else column_sums.chunked_column_sums
    with use_backend("torch"):
        _, lse = column_sums.attention_lse(query, keys, None, valid, key_pos, query_pos, 0.3)
        col, win = sums(query, keys, lse, valid, key_pos, query_pos, 0.3, window, chunk)
    col_ref, win_ref = every_key_column_sums(query, keys, lse, valid, key_pos, query_pos, 0.3, window, chunk)
    torch.testing.assert_close(col, col_ref, atol=1e-5, rtol=1e-5)
    if window:
        torch.testing.assert_close(win, win_ref, atol=1e-5, rtol=1e-5)
    else:
        assert win is None


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("chunk", [3, 512])
def test_ragged_rows_match_every_key_formulation(shape, chunk):
    query, keys, _, key_valid, key_pos, query_pos = ragged_case(shape, torch.float32)
    key_pos = key_pos.flip(-1).contiguous()  # slots out of position order: the span is no prefix
    with use_backend("torch"):
        _, lse = column_sums.attention_lse(query, keys, None, key_valid, key_pos, query_pos, 0.3)
        col, win = column_sums.column_sums_from_lse(query, keys, lse, key_valid, key_pos, query_pos, 0.3, 4, chunk)
    col_ref, win_ref = every_key_column_sums(query, keys, lse, key_valid, key_pos, query_pos, 0.3, 4, chunk)
    torch.testing.assert_close(col, col_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(win, win_ref, atol=1e-5, rtol=1e-5)


def test_visible_span_of_a_causal_chunk():
    _, _, valid, key_pos, query_pos = prompt_case(1, 1, 1, 10, 4)
    assert column_sums.visible_span(valid, key_pos, query_pos[:, 4:7]) == (5, 7)  # slots up to the first query; to the last
    padded = query_pos.clone()
    padded[0, 4] = -1  # a padding query sees nothing: no slot is seen by all
    assert column_sums.visible_span(valid, key_pos, padded[:, 4:7]) == (0, 7)


def test_only_a_prompt_pass_over_its_own_keys_is_one():
    _, _, valid, key_pos, query_pos = prompt_case(2, 2, 1, 9, 4)
    assert column_sums.is_prompt_pass(valid, key_pos, query_pos)
    assert not column_sums.is_prompt_pass(valid, key_pos, query_pos[:, 1:])  # a suffix of the queries
    assert not column_sums.is_prompt_pass(valid, key_pos.flip(-1), query_pos)  # slots out of order
    padded = valid.clone()
    padded[1, 0, 8] = False
    assert not column_sums.is_prompt_pass(padded, key_pos, query_pos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_causal_attention_lse_needs_no_repeated_keys(dtype):
    """The prompt pass's forward over a GQA group's shared K/V heads gives the bits of the fused op it used to
    run over the keys repeated to every query head, output and lse; on the CPU also the wrapped sdpa's output."""
    query, keys, *_ = prompt_case(2, 8, 2, 300, 64, dtype)
    values = torch.randn(keys.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    query, keys, values = (t.to(torch.get_default_device()) for t in (query, keys, values))
    if query.is_cuda and dtype == torch.float32:
        pytest.skip("a float32 CUDA prompt runs the Triton forward (test_attention_kernels)")
    out, lse = column_sums.causal_attention_lse(query, keys, values, 0.3)
    k, v = keys.repeat_interleave(4, dim=1), values.repeat_interleave(4, dim=1)
    if query.is_cuda:
        out_rep, lse_rep = torch.ops.aten._scaled_dot_product_cudnn_attention(query, k, v, None, True, 0.0, True,
                                                                              False, scale=0.3)[:2]
    else:
        out_rep, lse_rep = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, k, v, 0.0, True,
                                                                                      scale=0.3)
        sdpa = torch.nn.functional.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=0.3,
                                                                enable_gqa=True)
        assert torch.equal(out, sdpa)
    assert torch.equal(out, out_rep)
    assert torch.equal(lse, lse_rep.reshape(lse.shape).float())
