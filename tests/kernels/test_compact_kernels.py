"""Gather/compaction of ragged per-head caches: hand-computed values, and the Triton kernel bit-equal to torch."""

from __future__ import annotations

import pytest
import torch

from kvbench.kernels import triton_compact
from kvbench.kernels.compact import compact
from kvbench.kernels.dispatch import use_backend


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_hand_computed_compaction(backend):
    x = torch.arange(12.0).view(1, 2, 3, 2)  # head 0 slots: [0,1] [2,3] [4,5]; head 1: [6,7] [8,9] [10,11]
    index = torch.tensor([[[2, 0], [1, 1]]])
    lengths = torch.tensor([[2, 1]])
    with use_backend(backend):
        out = compact(x, index, lengths, fill=-1)
    assert out.tolist() == [[[[4.0, 5.0], [0.0, 1.0]], [[8.0, 9.0], [-1.0, -1.0]]]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.long], ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1), (2, 3, 123, 24, 70), (1, 2, 200, 128, 130)], ids=str)
def test_compaction_kernel_is_an_exact_copy(shape, dtype):
    B, H, T, D, K = shape
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(B, H, T, D, generator=g) * 100).to(dtype)
    index = torch.randint(0, T, (B, H, K), generator=g)
    lengths = torch.randint(0, K + 1, (B, H), generator=g)
    with use_backend("torch"):
        expected = compact(x, index, lengths)
    assert torch.equal(triton_compact.compact(x, index, lengths), expected)
