"""A prompt compression given the host's sizes (``HostSizes``) reads nothing back and changes nothing.

For every shipped method and the variants whose compression takes another code path (``test_decode_paths``'s
cases): ``compress`` with the sizes gives, to the bit, what it gives without them; ``Method.kept_lengths`` (the
lengths the engine installs without reading them) are the result's lengths wherever a method claims to know
them; and a shared pass's call over several budgets cuts (``Method.batch_row``) each row to what ``compress`` of
that row alone gives. The sizes are what lets a fused sweep's prompt compressions run without a wait on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbench.kernels.dispatch import use_backend
from kvbench.kv import AttentionStats, HostSizes, LayerKV
from tests.test_decode_paths import CASES, build

H, T, D = 2, 40, 8


def prompt_layer(rows: int, seed: int) -> tuple[LayerKV, AttentionStats]:
    """A prompt layer of ``rows`` rows (heads of unequal length: a chunked prompt's) and its statistics."""
    g = torch.Generator().manual_seed(seed)
    kv = LayerKV.from_dense(torch.randn(rows, H, T, D, generator=g), torch.randn(rows, H, T, D, generator=g))
    kv.lengths[:, 1] = torch.tensor([T - 9, T - 3, T - 17][:rows])
    kv.zero_padding()
    valid = kv.valid().float()

    def attention(heads: int) -> torch.Tensor:
        return torch.rand(rows, heads, T, generator=g) * (valid if heads == H else valid.repeat_interleave(2, 1))

    stats = AttentionStats(column_sums=attention(H), window_column_sums=attention(H), raw_keys=kv.keys.clone(),
                           query_column_sums=attention(2 * H), num_queries=torch.full((rows,), T))
    return kv, stats


def fresh(kv: LayerKV) -> LayerKV:
    """A copy a method may write (some put prefill state on their input)."""
    return LayerKV(keys=kv.keys.clone(), values=kv.values.clone(), positions=kv.positions.clone(),
                   lengths=kv.lengths.clone())


def assert_same(got: LayerKV, want: LayerKV) -> None:
    """Every tensor equal to the bit (NaN where NaN: D2O's threshold before a row's first eviction)."""
    tensors = [(name, getattr(got, name), getattr(want, name)) for name in ("lengths", "keys", "values", "positions")]
    assert got.state.keys() == want.state.keys() and got.tables.keys() == want.tables.keys()
    tensors += [(name, got.state[name], want.state[name]) for name in got.state]
    tensors += [(name, got.tables[name], want.tables[name]) for name in got.tables]
    for name, a, b in tensors:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_compression_given_the_hosts_sizes_is_the_compression_without_them(case):
    method = build(case)
    kv, stats = prompt_layer(3, seed=1)
    n_keep = torch.tensor([12, 50, 5])  # one budget over every row's length: that row keeps everything
    host = HostSizes(n_keep=n_keep.numpy(), lengths=kv.lengths.numpy().copy())
    assert not host.kept_alike()  # padding to clear: ``LayerKV.zero_padding`` given the sizes clears it
    with use_backend("torch"):
        want = method.compress(0, fresh(kv), stats, n_keep, "prefill")
        got = method.compress(0, fresh(kv), stats, n_keep, "prefill", host)
    assert_same(got, want)
    kept = method.kept_lengths(0, host)
    if method.keeps_exact_budget:
        assert kept is not None
    if kept is not None:
        assert kept.tolist() == want.lengths.tolist()


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_compression_whose_heads_keep_alike_given_the_hosts_sizes_is_the_compression_without_them(case):
    """One row whose heads are equally long, as a prompt pass leaves them: every head keeps as many slots, so a
    compression told so clears no padding (``HostSizes.kept_alike``), and gives the same bits."""
    method = build(case)
    kv, stats = prompt_layer(1, seed=4)
    kv.lengths[:] = T
    n_keep = torch.tensor([12])
    host = HostSizes(n_keep=n_keep.numpy(), lengths=kv.lengths.numpy().copy())
    assert host.kept_alike()
    with use_backend("torch"):
        want = method.compress(0, fresh(kv), stats, n_keep, "prefill")
        got = method.compress(0, fresh(kv), stats, n_keep, "prefill", host)
    assert_same(got, want)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_budgets_row_of_a_call_together_is_its_compression_alone(case):
    """The shared pass's call: one prompt row broadcast to a row per budget, each row cut to its own size."""
    method = build(case)
    one, stats = prompt_layer(1, seed=2)
    budgets = np.array([12, 50, 5])
    k = len(budgets)
    rows = LayerKV(keys=one.keys.expand(k, -1, -1, -1), values=one.values.expand(k, -1, -1, -1),
                   positions=one.positions.expand(k, -1, -1), lengths=one.lengths.expand(k, -1))
    host = HostSizes(n_keep=budgets, lengths=np.broadcast_to(one.lengths.numpy(), (k, H)))
    with use_backend("torch"):
        together = method.compress(0, rows, stats.broadcast(k), torch.from_numpy(budgets), "prefill", host)
        lengths = method.kept_lengths(0, host)
        lengths = together.lengths.numpy() if lengths is None else lengths
        for b in range(k):
            alone = method.compress(0, fresh(one), stats, torch.from_numpy(budgets[b:b + 1]), "prefill")
            row = method.batch_row(together, b, max(1, int(lengths[b].max())), host)
            assert row.lengths.tolist() == alone.lengths.tolist()
            valid = alone.valid()
            for name in ("keys", "values", "positions"):
                got, want = getattr(row, name), getattr(alone, name)
                assert got.shape == want.shape and torch.equal(got[valid], want[valid]), (b, name)
            assert {n: t.shape for n, t in row.tables.items()} == {n: t.shape for n, t in alone.tables.items()}
            for name in row.tables:
                assert torch.equal(row.tables[name], alone.tables[name]), (b, name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", sorted(CASES))
def test_on_cuda_a_call_together_given_the_hosts_sizes_makes_no_wait(case):
    """The shared pass's call, its rows cut and installed, with torch's sync debug mode set to error (the GPU
    runs, ``scripts/gpu_session.sh tests``): every method whose lengths the host knows makes no wait."""
    from kvbench.cache import CompressedCache

    method = build(case)
    one, stats = prompt_layer(1, seed=3)
    one = LayerKV(keys=one.keys.cuda(), values=one.values.cuda(), positions=one.positions.cuda(),
                  lengths=one.lengths.cuda())
    stats = AttentionStats(column_sums=stats.column_sums.cuda(), window_column_sums=stats.window_column_sums.cuda(),
                           raw_keys=one.keys.clone(), query_column_sums=stats.query_column_sums.cuda(),
                           num_queries=stats.num_queries)
    budgets = np.array([12, 50, 5])
    k = len(budgets)
    host = HostSizes(n_keep=budgets, lengths=np.broadcast_to(np.array([[T, T - 9]]), (k, H)))
    if method.kept_lengths(0, host) is None:
        pytest.skip(f"{case}: the data decide its lengths, which it reads back")
    rows = LayerKV(keys=one.keys.expand(k, -1, -1, -1), values=one.values.expand(k, -1, -1, -1),
                   positions=one.positions.expand(k, -1, -1), lengths=one.lengths.expand(k, -1))
    n_keep = torch.from_numpy(budgets).cuda()
    caches = [CompressedCache(1) for _ in range(k)]
    method.compress(0, rows, stats.broadcast(k), n_keep, "prefill", host)  # compiles the Triton kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        together = method.compress(0, rows, stats.broadcast(k), n_keep, "prefill", host)
        lengths = method.kept_lengths(0, host)
        for b, cache in enumerate(caches):
            cache.set_kv(0, method.batch_row(together, b, max(1, int(lengths[b].max())), host), lengths[b:b + 1])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [cache.kv(0).lengths.tolist() for cache in caches] == [[row] for row in lengths.tolist()]
