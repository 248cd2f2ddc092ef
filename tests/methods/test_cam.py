"""CaM: value merging into the next n kept tokens, merge probabilities, Bernoulli reproducibility, properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.errors import ConfigError
from kvbench.kv import AttentionStats, LayerKV
from kvbench.methods import cam
from kvbench.methods.cam import ATTENTION, CaM

VALUES = torch.tensor([10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0])


def toy(attention: list[float]) -> tuple[LayerKV, AttentionStats]:
    """One row of 8 slots, D = 1: key = slot index, value = 10 * (slot + 1)."""
    keys = torch.arange(8.0).view(1, 1, 8, 1)
    kv = LayerKV.from_dense(keys, VALUES.view(1, 1, 8, 1).clone())
    return kv, AttentionStats(column_sums=torch.tensor(attention).view(1, 1, 8), num_queries=torch.tensor([8]))


def test_streamingllm_prefill_merges_one_evicted_token_at_a_time():
    # sinks 1 + recent 4 kept (slots 0, 4..7); slots 1, 2, 3 leave in that order, each into the 2 slots after it
    # (the authors' streaming code, a prompt fed token by token). p = a_e / mean a over those 2 slots:
    # slot 1 -> slots 2, 3 (4, 0): p = 1/2; slot 2 -> 3, 4 (0, 2): p = min(1, 4/1) = 1; slot 3 -> 4, 5: p = 0.
    kv, stats = toy([9.0, 1.0, 4.0, 0.0, 2.0, 2.0, 7.0, 7.0])
    out = CaM(sinks=1, merge_tokens=2, deterministic=True).compress(0, kv, stats, torch.tensor([5]), "prefill")
    x1 = 20.0
    x2 = 30.0 + 0.5 * x1 / 2  # slot 2 carries half of slot 1's merged share when it leaves: 35
    x3 = 40.0 + (0.5 * x1 + 1.0 * x2) / 2  # 62.5, but p3 = 0: its value goes nowhere
    assert out.lengths.tolist() == [[5]]
    assert out.positions[0, 0].tolist() == [0, 4, 5, 6, 7]
    assert out.keys[0, 0, :, 0].tolist() == [0.0, 4.0, 5.0, 6.0, 7.0]  # keys of evicted tokens dropped
    assert out.values[0, 0, :, 0].tolist() == [10.0, 50.0 + (1.0 * x2 + 0.0 * x3) / 2, 60.0 + 0.0 * x3 / 2, 70.0, 80.0]


def test_h2o_eviction_merges_oldest_first_into_the_next_slots():
    # H2O, heavy_ratio 0.5 of 4 -> 2 heavy (1 sink + top score), 2 recent: keeps slots 0, 2, 6, 7; slots 1, 3,
    # 4, 5 leave oldest first, each into the next 2 slots (kept or leaving later). merge_tokens = 2.
    kv, stats = toy([9.0, 1.0, 8.0, 3.0, 0.5, 2.0, 4.0, 4.0])
    out = CaM(sinks=1, merge_tokens=2, eviction="h2o", deterministic=True).compress(
        0, kv, stats, torch.tensor([4]), "prefill")
    p1, p3, p4, p5 = 1.0 / 5.5, min(1.0, 3.0 / 1.25), 0.5 / 3.0, 2.0 / 4.0  # a_e / mean a of the next 2 slots
    x1 = 20.0
    x3 = 40.0 + p1 * x1 / 2  # slot 3 receives from slot 1 (slots 2, 3 are 1's targets)
    x4 = 50.0 + p3 * x3 / 2
    x5 = 60.0 + p3 * x3 / 2 + p4 * x4 / 2
    expected = [10.0, 30.0 + p1 * x1 / 2, 70.0 + p4 * x4 / 2 + p5 * x5 / 2, 80.0 + p5 * x5 / 2]
    assert out.positions[0, 0].tolist() == [0, 2, 6, 7]
    assert torch.allclose(out.values[0, 0, :, 0], torch.tensor(expected))


def test_fewer_than_n_targets_at_the_row_end():
    # recent window of 1: slots 1..6 leave in order, each into the (up to) 4 slots after it, p = 1 everywhere;
    # slot 6 has only slot 7 after it, which receives x6 / 4 (the mass meant for missing targets is lost).
    kv, stats = toy([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    out = CaM(sinks=1, merge_tokens=4, deterministic=True).compress(0, kv, stats, torch.tensor([2]), "prefill")
    x = {1: 20.0}
    for e in range(2, 7):
        x[e] = 10.0 * (e + 1) + sum(x[j] for j in range(max(1, e - 4), e)) / 4
    assert out.values[0, 0, :, 0].tolist() == pytest.approx([10.0, 80.0 + (x[3] + x[4] + x[5] + x[6]) / 4])


def test_cascade_solver_matches_the_sequential_merges(monkeypatch):
    # evicted_values solves the cascade in blocks; a block of 3 forces several block boundaries. Reference: the
    # merges one at a time in slot order, exactly what the authors' loop does.
    monkeypatch.setattr(cam, "CASCADE_BLOCK", 3)
    g = torch.Generator().manual_seed(1)
    for n in (1, 2, 5):
        values = torch.randn(2, 3, 17, 4, generator=g)
        evicted = torch.rand(2, 3, 17, generator=g) < 0.6
        share = torch.rand(2, 3, 17, generator=g) * evicted / n
        got = cam.evicted_values(values, share, evicted, n)
        held = values.clone()
        for e in range(17):
            leaving = evicted[..., e]
            for t in range(e + 1, min(17, e + n + 1)):
                held[..., t, :] += torch.where(leaving, share[..., e], 0.0).unsqueeze(-1) * held[..., e, :]
        assert torch.allclose(got[evicted], held[evicted], atol=1e-5)
        assert (got[~evicted] == 0).all()


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
    # slots 1, 2, 3 leave in order, one target each (n = 1): p = 1, 1, then 1/2 for slot 3 -> slot 4
    kv, stats = toy([9.0, 1.0, 1.0, 1.0, 2.0, 2.0, 7.0, 7.0])
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
