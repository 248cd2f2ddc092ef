"""CaM's merge shares in one Triton launch against the torch reference (bit-identical: the Bernoulli draws
compare a hash with the probability, so any rounding difference could flip a merge)."""

from __future__ import annotations

import pytest
import torch

from kvbench.kernels import triton_cam
from kvbench.kernels.cam_step import draw_key
from kvbench.kv import LayerKV
from kvbench.methods.cam import CaM


@pytest.mark.parametrize("deterministic", [False, True])
def test_merge_shares_kernel_is_bit_identical(deterministic):
    g = torch.Generator().manual_seed(3)
    B, H, T = 2, 3, 700
    kv = LayerKV.from_dense(torch.zeros(B, H, T, 1), torch.zeros(B, H, T, 1),
                            positions=(torch.arange(T) + 5).expand(B, H, T).clone())
    kv.lengths[1, 1] = 333
    kv.zero_padding()
    attention = torch.rand(B, H, T, generator=g) * (torch.rand(B, H, T, generator=g) < 0.8) * kv.valid()
    evicted = kv.valid() & (torch.rand(B, H, T, generator=g) < 0.7)
    method = CaM(seed=12345, deterministic=deterministic)
    expected = method._merge_mask(3, kv, method._merge_probabilities(kv, attention, evicted), kv.positions) / 16
    newest = torch.where(kv.valid(), kv.positions, -1).amax(-1)
    got = triton_cam.merge_shares(attention, kv.lengths, kv.positions, evicted, newest, 16,
                                  None if deterministic else draw_key(method.seed, 3))
    assert torch.equal(got, expected)
    assert 0 < int((got > 0).sum()) < int(evicted.sum()) or deterministic
