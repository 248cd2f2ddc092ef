"""WeightedKV's next-later search in one Triton launch against the torch reference (sparse table + lifting)."""

from __future__ import annotations

import pytest
import torch

from kvbench.kernels import triton_next_later
from kvbench.methods.weightedkv import next_later


@pytest.mark.parametrize("T", [1, 2, 127, 128, 300, 700])
def test_next_later_kernel_matches_reference(T):
    g = torch.Generator().manual_seed(T)
    deleted = torch.rand(2, 3, T, generator=g) < 0.8
    rank = torch.rand(2, 3, T, generator=g).argsort(-1)
    time = torch.where(deleted, rank, T)  # deletion times, survivors at T (ties among them)
    time[1, 2] = torch.arange(T).flip(0)  # decreasing: nothing later is larger
    assert torch.equal(triton_next_later.next_later(time), next_later(time))
