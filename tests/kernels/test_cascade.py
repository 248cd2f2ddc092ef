"""The banded recurrence solved by blocks and a carry, against its definition run slot after slot; the Triton
twins of its two steps against the torch references."""

from __future__ import annotations

import pytest
import torch

from kvbench.kernels import cascade, triton_cascade
from kvbench.kernels.cascade import banded_cascade
from kvbench.kernels.dispatch import use_backend


def sequential(values: torch.Tensor, coefficient: torch.Tensor, width: int) -> torch.Tensor:
    """x_s = v_s + sum_{k=1..width} c_{s-k} x_{s-k}, one slot at a time, in float64."""
    x = values.double().clone()
    for s in range(values.shape[2]):
        for k in range(1, min(width, s) + 1):
            x[:, :, s] += coefficient[:, :, s - k, None].double() * x[:, :, s - k]
    return x


CASES = [(1, 1, 4, "torch"), (5, 3, 4, "torch"), (37, 4, 4, "torch"), (100, 5, 4, "torch"), (130, 16, 64, "torch"),
         (300, 16, 16, "torch"), (5, 3, 4, "triton"), (37, 4, 8, "triton"), (90, 16, 16, "triton")]


@pytest.mark.parametrize("T, width, block, backend", CASES)
def test_banded_cascade_matches_the_sequential_solve(T, width, block, backend):
    g = torch.Generator().manual_seed(T)
    values = torch.randn(1, 2, T, 6, generator=g)
    coefficient = torch.rand(1, 2, T, generator=g) * (torch.rand(1, 2, T, generator=g) < 0.7) / width
    with use_backend(backend):
        got = banded_cascade(values, coefficient, width, block)
    torch.testing.assert_close(got.double(), sequential(values, coefficient, width), atol=1e-5, rtol=1e-5)


def test_growing_values_keep_their_relative_precision():
    # coefficients summing to 1 over the band: x grows linearly along the row, the worst case for rounding
    T, width = 2048, 16
    values = torch.randn(1, 2, T, 8, generator=torch.Generator().manual_seed(1))
    coefficient = torch.full((1, 2, T), 1.0 / width)
    expected = sequential(values, coefficient, width)
    got = banded_cascade(values, coefficient, width)
    assert float((got.double() - expected).abs().max()) <= 1e-5 * float(expected.abs().max())


@pytest.mark.parametrize("S, width, C", [(1, 1, 1), (4, 3, 5), (64, 16, 40), (37, 5, 33)])
def test_block_solve_kernel_matches_reference(S, width, C):
    g = torch.Generator().manual_seed(S)
    coefficient = torch.rand(2, S, generator=g) / width
    rhs = torch.randn(2, S, C, generator=g)
    torch.testing.assert_close(triton_cascade.block_solve(coefficient, rhs, width),
                               cascade.block_solve(coefficient, rhs, width), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("blocks, width, C", [(1, 1, 1), (5, 3, 7), (40, 16, 128), (9, 20, 33)])
def test_carry_states_kernel_matches_reference(blocks, width, C):
    g = torch.Generator().manual_seed(blocks)
    matrix = torch.rand(3, blocks, width, width + 4, generator=g)[..., :width] / width  # a strided view
    state = torch.randn(3, blocks, width, C, generator=g)
    torch.testing.assert_close(triton_cascade.carry_states(matrix, state), cascade.carry_states(matrix, state),
                               atol=1e-5, rtol=1e-5)
