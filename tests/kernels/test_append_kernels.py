"""``append_slots`` (the cache write of ragged rows and of captured decode steps): the Triton kernel writes
exactly what the torch reference writes, for one token and for a chunk that crosses its token tiles, with
and without per-slot states, from the strided (B, H, q, D) views the model hands the cache."""

from __future__ import annotations

import pytest
import torch

from kvbench.kernels import triton_append
from kvbench.kernels.append import append_slots
from kvbench.kernels.dispatch import use_backend


def storage(dtype, states: int, seed=0):
    B, H, C, D = 2, 3, 40, 24
    g = torch.Generator().manual_seed(seed)
    return dict(lengths=torch.tensor([[0, 7, 19], [3, 3, 1]]), keys=torch.randn(B, H, C, D, generator=g).to(dtype),
                values=torch.randn(B, H, C, D + 8, generator=g).to(dtype), positions=torch.randint(0, 99, (B, H, C),
                                                                                                   generator=g),
                state=torch.rand(states, B, H, C, generator=g))


@pytest.mark.parametrize("states", [0, 2])
@pytest.mark.parametrize("q", [1, 19])
def test_triton_append_writes_what_the_reference_writes(q, states, dtype):
    g = torch.Generator().manual_seed(1)
    # the model's keys are (B, q, H, D) projections seen as (B, H, q, D): strided
    new_keys = torch.randn(2, q, 3, 24, generator=g).to(dtype).transpose(1, 2)
    new_values = torch.randn(2, q, 3, 32, generator=g).to(dtype).transpose(1, 2)
    new_positions = 100 + torch.arange(q).repeat(2, 1)
    want, got = storage(dtype, states), storage(dtype, states)
    with use_backend("torch"):
        append_slots(new_keys, new_values, new_positions, **want)
    triton_append.append_slots(new_keys, new_values, new_positions, **got)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert want["lengths"].tolist() == [[q, 7 + q, 19 + q], [3 + q, 3 + q, 1 + q]]
