"""CaM's prompt cascade, solved over every slot by blocks and a scan, against the previous formulation: the
evicted slots compacted and solved block after block, then their shares spread onto the n slots after them."""

from __future__ import annotations

import pytest
import torch

from kvbench.kernels.select import true_first
from kvbench.kv import AttentionStats, LayerKV
from kvbench.methods import cam
from kvbench.methods.cam import CaM


def window_sum(x: torch.Tensor, n: int) -> torch.Tensor:
    """out[..., k, :] = sum of x[..., k - n : k, :]."""
    out = torch.zeros_like(x)
    for offset in range(1, min(n, x.shape[2] - 1) + 1):
        out[:, :, offset:] += x[:, :, :-offset]
    return out


def compact_evicted_values(values, share, evicted, n, block=256):
    """The previous ``evicted_values``: the evicted slots compacted in order, a triangular solve per block."""
    B, H, T, D = values.shape
    count = evicted.sum(-1)
    E = int(count.max())
    out = torch.zeros_like(values)
    if E == 0:
        return out
    order = true_first(evicted)[..., :E]
    real = torch.arange(E).view(1, 1, -1) < count.unsqueeze(-1)
    slot = torch.where(real, order, -2 * (n + 1) * E)
    c = torch.where(real, share.gather(2, order), 0.0)
    v = torch.where(real.unsqueeze(-1), values.gather(2, order.unsqueeze(-1).expand(-1, -1, -1, D)), 0.0)
    x = torch.empty_like(v)
    size = max(block, n)
    for start in range(0, E, size):
        stop, known = min(E, start + size), max(0, start - n)
        gap = slot[..., start:stop, None] - slot[..., None, known:stop]
        coupling = ((gap >= 1) & (gap <= n)) * c[..., None, known:stop]
        rhs = v[..., start:stop, :] + coupling[..., :start - known] @ x[..., known:start, :]
        x[..., start:stop, :] = torch.linalg.solve_triangular(torch.eye(stop - start) - coupling[..., start - known:],
                                                              rhs, upper=False, unitriangular=True)
    return out.scatter_(2, order.unsqueeze(-1).expand(-1, -1, -1, D), torch.where(real.unsqueeze(-1), x, 0.0))


def previous_values(kv: LayerKV, index, share, evicted, n):
    """The previous compress's kept values: the carried x_e spread onto the n slots after each evicted e."""
    carried = compact_evicted_values(kv.values.float(), share, evicted, n)
    received = window_sum(carried * share.unsqueeze(-1), n)
    kept = kv.values.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, kv.values.shape[-1])).float()
    return kept + received.gather(2, index.unsqueeze(-1).expand_as(kept))


@pytest.mark.parametrize("eviction", ["streamingllm", "h2o"])
@pytest.mark.parametrize("n", [1, 3, 16])
def test_compress_keeps_the_previous_values(monkeypatch, eviction, n):
    g = torch.Generator().manual_seed(n)
    B, H, T, D = 2, 3, 301, 8
    keys, values = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    kv = LayerKV.from_dense(keys, values)
    kv.lengths[1, 2] = 200  # a ragged row, padding zeroed as the engine hands it
    kv.zero_padding()
    stats = AttentionStats(column_sums=torch.rand(B, H, T, generator=g) * kv.valid(), num_queries=torch.tensor([T, T]))
    n_keep = torch.tensor([60, 45])
    method = CaM(merge_tokens=n, eviction=eviction)
    spied = {}
    original = cam.evicted_values

    def spy(values, share, slots, width):
        spied["share"] = share
        return original(values, share, slots, width)

    monkeypatch.setattr(cam, "evicted_values", spy)
    monkeypatch.setattr(cam, "CASCADE_BLOCK", 16)  # several blocks, so the scan carries across them
    out = method.compress(0, kv, stats, n_keep, "prefill")
    index, _ = method._select(kv.state[cam.ATTENTION], torch.minimum(n_keep.view(-1, 1), kv.lengths), kv.lengths)
    valid = kv.valid()
    evicted = valid & ~torch.zeros_like(valid).scatter_(2, index, True)
    expected = previous_values(kv, index, spied["share"], evicted, n)
    assert (spied["share"][evicted] > 0).any()  # the draws merge something
    real = out.valid().unsqueeze(-1)
    assert torch.allclose(torch.where(real, out.values, 0.0), torch.where(real, expected, 0.0), rtol=1e-5, atol=1e-5)


def test_long_row_cascade_agrees_with_the_compacted_solve():
    # every slot evicted with the largest shares (p = 1): values grow along the row, the case most sensitive to
    # how the sums are ordered
    g = torch.Generator().manual_seed(0)
    n, T = 16, 4096
    values = torch.randn(1, 2, T, 32, generator=g)
    evicted = torch.ones(1, 2, T, dtype=torch.bool)
    share = torch.full((1, 2, T), 1.0 / n)
    got = cam.evicted_values(values, share, evicted, n)
    expected = compact_evicted_values(values.double(), share.double(), evicted, n).float()
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))

