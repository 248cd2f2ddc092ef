"""CaM: value merging into the next n kept tokens, merge probabilities, Bernoulli reproducibility, properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.errors import ConfigError
from kvbench.kv import AttentionStats, LayerKV
from kvbench.methods.cam import ATTENTION, CaM

VALUES = torch.tensor([10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0])


def toy(attention: list[float]) -> tuple[LayerKV, AttentionStats]:
    """One row of 8 slots, D = 1: key = slot index, value = 10 * (slot + 1)."""
    keys = torch.arange(8.0).view(1, 1, 8, 1)
    kv = LayerKV.from_dense(keys, VALUES.view(1, 1, 8, 1).clone())
    return kv, AttentionStats(column_sums=torch.tensor(attention).view(1, 1, 8), num_queries=torch.tensor([8]))


def test_streamingllm_merge_into_next_n_kept_tokens_deterministic():
    # sinks 1 + recent 4 kept (slots 0, 4..7); slots 1, 2, 3 evicted; their targets are slots 4 and 5.
    # mean target attention = (2 + 2) / 2 = 2 -> p = (1/2, 4/2 -> 1, 0/2) = (0.5, 1, 0).
    kv, stats = toy([9.0, 1.0, 4.0, 0.0, 2.0, 2.0, 7.0, 7.0])
    out = CaM(sinks=1, merge_tokens=2, deterministic=True).compress(0, kv, stats, torch.tensor([5]), "prefill")
    added = (0.5 * 20 + 1.0 * 30 + 0.0 * 40) / 2  # = 20, each of the two targets gets it
    assert out.lengths.tolist() == [[5]]
    assert out.positions[0, 0].tolist() == [0, 4, 5, 6, 7]
    assert out.keys[0, 0, :, 0].tolist() == [0.0, 4.0, 5.0, 6.0, 7.0]  # keys of evicted tokens dropped
    assert out.values[0, 0, :, 0].tolist() == [10.0, 50.0 + added, 60.0 + added, 70.0, 80.0]


def test_h2o_eviction_targets_follow_each_evicted_token():
    # H2O, heavy_ratio 0.5 of 4 -> 2 heavy (1 sink + top score), 2 recent: keeps slots 0, 2, 6, 7.
    # Evicted 1 -> targets slots 2, 6; evicted 3, 4, 5 -> targets 6, 7. merge_tokens = 2.
    kv, stats = toy([9.0, 1.0, 8.0, 3.0, 0.5, 2.0, 4.0, 4.0])
    out = CaM(sinks=1, merge_tokens=2, eviction="h2o", deterministic=True).compress(
        0, kv, stats, torch.tensor([4]), "prefill")
    p1 = 1.0 / ((8.0 + 4.0) / 2)  # 1/6
    p345 = [3.0 / 4.0, 0.5 / 4.0, 2.0 / 4.0]
    from_1 = p1 * 20 / 2
    from_345 = sum(p * v for p, v in zip(p345, [40.0, 50.0, 60.0])) / 2
    assert out.positions[0, 0].tolist() == [0, 2, 6, 7]
    expected = [10.0, 30.0 + from_1, 70.0 + from_1 + from_345, 80.0 + from_345]
    assert torch.allclose(out.values[0, 0, :, 0], torch.tensor(expected))


def test_fewer_than_n_targets_at_the_row_end():
    # recent window of 1: the evicted slots 1..6 have only slot 7 after them; p uses that slot alone, and it
    # receives v / n with n = 4 (the mass meant for missing targets is lost).
    kv, stats = toy([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    out = CaM(sinks=1, merge_tokens=4, deterministic=True).compress(0, kv, stats, torch.tensor([2]), "prefill")
    assert out.values[0, 0, :, 0].tolist() == [10.0, 80.0 + (20 + 30 + 40 + 50 + 60 + 70) / 4]


def test_decode_step_merges_the_token_leaving_the_window():
    kv, stats = toy([9.0, 1.0, 4.0, 0.0, 2.0, 2.0, 7.0, 7.0])
    cam = CaM(sinks=1, merge_tokens=2, deterministic=True)
    out = cam.compress(0, kv, AttentionStats(column_sums=torch.zeros(1, 1, 8)), torch.tensor([8]), "prefill")
    out.append(torch.full((1, 1, 1, 1), 8.0), torch.full((1, 1, 1, 1), 90.0), torch.tensor([[8]]))
    step = torch.tensor([0.1, 0.3, 0.0, 0.0, 0.1, 0.1, 0.0, 0.0, 0.4]).view(1, 1, 9)
    cam.observe(0, out, AttentionStats(step_attention=step).aligned(out.capacity))  # as the engine hands it
    assert torch.allclose(out.state[ATTENTION][0, 0, :9], step[0, 0])
    out = cam.compress(0, out, AttentionStats(), torch.tensor([8]), "decode")
    # slot 1 leaves (score 0.3); targets slots 2, 3 with mean 0 -> p = 1; each gets 20 / 2.
    assert out.positions[0, 0].tolist() == [0, 2, 3, 4, 5, 6, 7, 8]
    assert out.values[0, 0, :3, 0].tolist() == [10.0, 40.0, 50.0]


def test_bernoulli_mask_is_seeded_and_binary():
    kv, stats = toy([9.0, 1.0, 1.0, 1.0, 2.0, 2.0, 7.0, 7.0])  # p = 0.5 for the three evicted slots
    runs = [CaM(sinks=1, merge_tokens=1, seed=s).compress(0, toy([9.0, 1.0, 1.0, 1.0, 2.0, 2.0, 7.0, 7.0])[0],
                                                          stats, torch.tensor([5]), "prefill") for s in (3, 3)]
    assert torch.equal(runs[0].values, runs[1].values)
    added = runs[0].values[0, 0, 1, 0] - 50.0
    assert float(added) in {sum(m * v for m, v in zip(mask, (20, 30, 40)))
                            for mask in [(a, b, c) for a in (0, 1) for b in (0, 1) for c in (0, 1)]}
    draws = {float(CaM(sinks=1, merge_tokens=1, seed=s).compress(0, toy([9.0, 1.0, 1.0, 1.0, 2.0, 2.0, 7.0, 7.0])[0],
                                                                stats, torch.tensor([5]), "prefill").values[0, 0, 1, 0])
             for s in range(12)}
    assert len(draws) > 1  # the mask is random across seeds


def test_bad_config_names_the_value():
    with pytest.raises(ConfigError, match="eviction 'tova'"):
        CaM(eviction="tova")
    with pytest.raises(ConfigError, match="merge_tokens=0"):
        CaM(merge_tokens=0)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 24), st.integers(1, 24), st.integers(1, 5),
       st.sampled_from(["streamingllm", "h2o"]), st.booleans(), st.integers(0, 10_000))
def test_properties(B, H, T, keep, n, eviction, deterministic, seed):
    g = torch.Generator().manual_seed(seed)
    kv = LayerKV.from_dense(torch.randn(B, H, T, 4, generator=g), torch.randn(B, H, T, 4, generator=g))
    stats = AttentionStats(column_sums=torch.rand(B, H, T, generator=g), num_queries=torch.full((B,), T))
    cam = CaM(merge_tokens=n, eviction=eviction, deterministic=deterministic, seed=seed)
    n_keep = torch.full((B,), keep)
    out = cam.compress(0, kv, stats, n_keep, "prefill")
    again = cam.compress(0, LayerKV.from_dense(kv.keys, kv.values), stats, n_keep, "prefill")
    assert (out.lengths <= min(keep, T)).all() and (out.lengths == min(keep, T)).all()
    assert out.keys.shape[2] == out.values.shape[2] == out.positions.shape[2] == int(out.lengths.max())
    assert torch.isfinite(out.values).all() and torch.isfinite(out.keys).all()
    assert torch.equal(out.values, again.values) and torch.equal(out.positions, again.positions)
    # keys are never merged: every kept key is its own slot's key
    assert torch.equal(out.keys, kv.keys.gather(2, out.positions.unsqueeze(-1).expand(-1, -1, -1, 4)))
