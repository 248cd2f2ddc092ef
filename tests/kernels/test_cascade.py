"""The banded recurrence solved by blocks and a scan, against its definition run slot after slot."""

from __future__ import annotations

import pytest
import torch

from kvbench.kernels.cascade import banded_cascade, unit_lower_inverse


def sequential(values: torch.Tensor, coefficient: torch.Tensor, width: int) -> torch.Tensor:
    """x_s = v_s + sum_{k=1..width} c_{s-k} x_{s-k}, one slot at a time, in float64."""
    x = values.double().clone()
    for s in range(values.shape[2]):
        for k in range(1, min(width, s) + 1):
            x[:, :, s] += coefficient[:, :, s - k, None].double() * x[:, :, s - k]
    return x


def test_unit_lower_inverse_inverts():
    g = torch.Generator().manual_seed(0)
    strict = torch.rand(3, 16, 16, generator=g).tril(-1)
    expected = torch.linalg.inv(torch.eye(16, dtype=torch.float64) - strict.double())
    torch.testing.assert_close(unit_lower_inverse(strict).double(), expected, atol=0, rtol=1e-5)


@pytest.mark.parametrize("T, width, block", [(1, 1, 4), (5, 3, 4), (37, 4, 4), (100, 5, 4), (130, 16, 64),
                                             (300, 16, 16)])
def test_banded_cascade_matches_the_sequential_solve(T, width, block):
    g = torch.Generator().manual_seed(T)
    values = torch.randn(2, 3, T, 6, generator=g)
    coefficient = torch.rand(2, 3, T, generator=g) * (torch.rand(2, 3, T, generator=g) < 0.7) / width
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
