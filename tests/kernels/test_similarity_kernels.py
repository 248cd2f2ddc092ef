"""Triton twins of the similarity (KVMerger) and matching (Chelsea) references, on odd shapes and dtypes."""

from __future__ import annotations

import pytest
import torch

from kvbench.kernels import matching, redundancy, similarity, triton_matching, triton_similarity


def clustered_keys(B, H, T, D, dtype, seed=3):
    """Keys around one direction per row, so that runs and matches are non-trivial; row (0, 0) ends in padding."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, 1, D, generator=g) + 0.7 * torch.randn(B, H, T, D, generator=g)
    keys[0, 0, T - T // 4:] = 0
    return keys.to(dtype)


def test_adjacent_cosine_hand_computed():
    keys = torch.tensor([[[[1.0, 0.0], [1.0, 1.0], [0.0, 2.0], [0.0, 0.0]]]])
    got = triton_similarity.adjacent_cosine(keys)
    torch.testing.assert_close(got, torch.tensor([[[2**-0.5, 2**-0.5, 0.0]]]))


@pytest.mark.parametrize("shape", [(1, 1, 1, 16), (1, 1, 2, 3), (2, 3, 123, 24)], ids=str)
def test_adjacent_cosine_matches_reference(shape, dtype):
    keys = clustered_keys(*shape, dtype)
    got = triton_similarity.adjacent_cosine(keys)
    assert got.shape == (*shape[:2], shape[2] - 1)
    torch.testing.assert_close(got, similarity.adjacent_cosine(keys), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("shape", [(1, 1, 1, 8), (2, 1, 29, 24)], ids=str)
def test_anchor_runs_match_reference(shape, dtype):
    B, H, T, _ = shape
    keys = clustered_keys(*shape, dtype)
    g = torch.Generator().manual_seed(4)
    mergeable = torch.rand(B, H, T, generator=g) > 0.2
    lengths = torch.randint(1, T + 1, (B, H), generator=g)
    expected = similarity.anchor_runs(keys, mergeable, lengths, 0.5)
    assert torch.equal(triton_similarity.anchor_runs(keys, mergeable, lengths, 0.5), expected)


@pytest.mark.parametrize("chunk_size", [None, 7, 16], ids=str)
def test_chunked_soft_matching_matches_reference(chunk_size, dtype):
    keys = clustered_keys(2, 2, 37, 24, dtype)
    start = torch.tensor([[0, 5], [3, 0]])
    count = torch.tensor([[37, 1], [34, 2]])  # a region of one slot has no B set: no edge
    partner_ref, sim_ref = matching.chunked_soft_matching(keys, start, count, chunk_size)
    partner, sim = triton_matching.chunked_soft_matching(keys, start, count, chunk_size)
    assert torch.equal(partner, partner_ref)
    assert (partner[0, 1] == -1).all() and (partner >= 0).sum() > 15
    torch.testing.assert_close(sim, sim_ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("shape", [(1, 1, 1, 16), (2, 3, 150, 24), (1, 2, 130, 128)], ids=str)
def test_best_match_cosine_matches_reference(shape, dtype):
    B, H, T, D = shape
    keys = clustered_keys(*shape, dtype)
    g = torch.Generator().manual_seed(5)
    targets = torch.rand(B, H, T, generator=g) < 0.3
    sources = ~targets & (torch.rand(B, H, T, generator=g) < 0.9)
    if H > 1:
        targets[0, 1] = False  # a row without targets: its sources get no match
    expected = similarity.best_match_cosine(keys, sources, targets, chunk=7)
    got = triton_similarity.best_match_cosine(keys, sources, targets)
    assert torch.equal(got[1], expected[1])
    torch.testing.assert_close(got[0], expected[0], atol=1e-6, rtol=1e-6)


def test_best_match_cosine_ties_go_to_the_earliest_target():
    # slots 1, 3 and 70 hold the same direction (70 in a later target tile): every source picks slot 1
    keys = torch.randn(1, 1, 80, 16, generator=torch.Generator().manual_seed(6))
    keys[0, 0, [3, 70]] = 2 * keys[0, 0, 1]
    keys[0, 0, 0] = keys[0, 0, 1]
    targets = torch.zeros(1, 1, 80, dtype=torch.bool)
    targets[0, 0, [1, 3, 70] + list(range(10, 60))] = True
    sources = torch.zeros_like(targets)
    sources[0, 0, 0] = True
    similarity_, match = triton_similarity.best_match_cosine(keys, sources, targets)
    assert match[0, 0, 0] == 1 and (match[0, 0, 1:] == -1).all()
    assert float(similarity_[0, 0, 0]) == pytest.approx(1.0)


@pytest.mark.parametrize("similarity_", ["key_value", "key", "value"])
def test_most_redundant_matches_reference(similarity_, dtype):
    B, H, T, D = 2, 2, 140, 24
    raw = clustered_keys(B, H, T, D, dtype)
    values = clustered_keys(B, H, T, D, dtype, seed=8)
    g = torch.Generator().manual_seed(9)
    order = torch.rand(B, H, T, generator=g).argsort(-1)
    sources, targets = order[..., :90], order[..., 90:]  # slot lists; some entries past the counts
    source_count = torch.tensor([[90, 17], [0, 66]])
    target_count = torch.tensor([[50, 3], [20, 0]])  # a row without targets
    expected = redundancy.most_redundant(raw, values, sources, source_count, targets, target_count, similarity_,
                                         chunk=16)
    got = triton_similarity.most_redundant(raw, values, sources, source_count, targets, target_count, similarity_)
    assert torch.equal(got[1], expected[1])
    torch.testing.assert_close(got[0], expected[0], atol=1e-6, rtol=1e-6)
    assert (got[1][0, 0] >= 0).all() and (got[1][1, 1] == -1).all() and (got[1][1, 0] == -1).all()
