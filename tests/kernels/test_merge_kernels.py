"""Triton scatter_merge / group_sum against hand-computed values and the torch references."""

from __future__ import annotations

import pytest
import torch

from kvbench.kernels import merge, triton_merge
from kvbench.kernels.dispatch import use_backend


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_hand_computed_merge(backend):
    x = torch.tensor([[[[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0]]]])  # (1, 1, 4, 2)
    target = torch.tensor([[[0, 1, 0, -1]]])
    weight = torch.tensor([[[0.5, 1.0, 0.25, 9.0]]])
    with use_backend(backend):
        merged = merge.scatter_merge(x, target, weight, 3)
        mass = merge.group_sum(weight, target, 3)
    assert merged.tolist() == [[[[1.25, 12.5], [2.0, 20.0], [0.0, 0.0]]]]
    assert mass.tolist() == [[[0.75, 1.0, 0.0]]]


# (B, H, T, D, groups): one slot, tiles not multiples of 64, head dims not powers of two
SHAPES = [(1, 1, 1, 1, 1), (2, 3, 123, 24, 10), (1, 2, 64, 128, 70), (2, 1, 65, 5, 1)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_merge_kernels_match_reference(shape, dtype, output_tolerance):
    B, H, T, D, G = shape
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, H, T, D, generator=g).to(dtype)
    target = torch.randint(-1, G, (B, H, T), generator=g)
    weight = torch.rand(B, H, T, generator=g)
    got = triton_merge.scatter_merge(x, target, weight, G)
    assert got.dtype == dtype and got.shape == (B, H, G, D)
    torch.testing.assert_close(got.float(), merge.scatter_merge(x, target, weight, G).float(), **output_tolerance)
    torch.testing.assert_close(triton_merge.group_sum(weight, target, G), merge.group_sum(weight, target, G))
