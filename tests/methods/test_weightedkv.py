"""WeightedKV: the paper's toy merge, repeated prefill merges by hand, a/n bookkeeping, properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.errors import ConfigError
from kvbench.kv import AttentionStats, LayerKV
from kvbench.methods.weightedkv import ACCUMULATED, OBSERVED, WeightedKV, merge_in_order, merge_into_right


def one_hot_row(T: int) -> LayerKV:
    """Keys = slot index; value of slot i = e_i (D = T), so a merged value shows its weights directly."""
    return LayerKV.from_dense(torch.arange(float(T)).view(1, 1, T, 1).expand(1, 1, T, T).clone(),
                              torch.eye(T).view(1, 1, T, T))


def test_paper_toy_example_v2_over_6_plus_5_v3_over_6():
    # Fig. 3, m = 4: five slots with average scores; v2 (0.1) is the lowest and merges into v3 (0.5).
    kv = one_hot_row(5)
    kv.state[ACCUMULATED] = torch.tensor([0.3, 0.1, 0.5, 0.2, 0.4]).view(1, 1, 5) * 2
    kv.state[OBSERVED] = torch.full((1, 1, 5), 2.0)
    out = WeightedKV(sinks=0, recent=1).compress(0, kv, AttentionStats(), torch.tensor([4]), "decode")
    assert out.positions[0, 0].tolist() == [0, 2, 3, 4]
    assert out.keys[0, 0, :, 0].tolist() == [0.0, 2.0, 3.0, 4.0]  # k2 discarded, v3's slot keeps k3
    assert out.values[0, 0, 1].tolist() == pytest.approx([0, 1 / 6, 5 / 6, 0, 0])
    assert out.values[0, 0, 0].tolist() == [1, 0, 0, 0, 0]
    # the survivor keeps its own a and n
    assert out.state[ACCUMULATED][0, 0].tolist() == pytest.approx([0.6, 1.0, 0.4, 0.8])
    assert out.state[OBSERVED][0, 0].tolist() == [2.0, 2.0, 2.0, 2.0]


def test_prefill_applies_the_rule_repeatedly():
    # 6 prompt slots, n = 6, 5, 4, 3, 2, 1 queries; budget 3, 1 sink, 1 recent -> region slots 1..4.
    # a chosen so that a_bar = [1/3, 0.2, 0.1, 0.4, 0.3, 0.5].
    column_sums = torch.tensor([2.0, 1.0, 0.4, 1.2, 0.6, 0.5]).view(1, 1, 6)
    out = WeightedKV(sinks=1, recent=1).compress(0, one_hot_row(6), AttentionStats(column_sums=column_sums),
                                                 torch.tensor([3]), "prefill")
    # 1) slot 2 (0.1) -> slot 3 (0.4): 0.2 v2 + 0.8 v3
    # 2) slot 1 (0.2) -> slot 3, now its right neighbour: (0.2 v1 + 0.4 (0.2 v2 + 0.8 v3)) / 0.6
    # 3) slot 4 (0.3) -> slot 5 (0.5): 0.375 v4 + 0.625 v5
    assert out.positions[0, 0].tolist() == [0, 3, 5]
    assert out.values[0, 0, 0].tolist() == [1, 0, 0, 0, 0, 0]
    assert out.values[0, 0, 1].tolist() == pytest.approx([0, 1 / 3, 0.4 * 0.2 / 0.6, 0.4 * 0.8 / 0.6, 0, 0])
    assert out.values[0, 0, 2].tolist() == pytest.approx([0, 0, 0, 0, 0.375, 0.625])
    assert out.state[OBSERVED][0, 0].tolist() == [6.0, 3.0, 1.0]


def test_observe_accumulates_attention_and_counts():
    kv = one_hot_row(3)
    wkv = WeightedKV()
    wkv.compress(0, kv, AttentionStats(column_sums=torch.tensor([1.5, 1.0, 0.5]).view(1, 1, 3)),
                 torch.tensor([8]), "prefill")
    kv.append(torch.zeros(1, 1, 1, 3), torch.zeros(1, 1, 1, 3), torch.tensor([[3]]))
    wkv.observe(0, kv, AttentionStats(step_attention=torch.tensor([0.4, 0.3, 0.2, 0.1]).view(1, 1, 4)))
    assert kv.state[ACCUMULATED][0, 0, :4].tolist() == pytest.approx([1.9, 1.3, 0.7, 0.1])
    assert kv.state[OBSERVED][0, 0, :4].tolist() == [4.0, 3.0, 2.0, 1.0]


def test_a_pass_of_q_tokens_counts_q_observations():
    # Algorithm 1 adds 1 to n per query: a pass feeding 3 tokens at once adds 3 to the 2 older slots and
    # 3, 2, 1 to its own tokens (causal: the i-th new token is seen by the q - i queries at or after it).
    kv = one_hot_row(2)
    wkv = WeightedKV()
    wkv.compress(0, kv, AttentionStats(column_sums=torch.tensor([1.5, 0.5]).view(1, 1, 2)), torch.tensor([8]),
                 "prefill")
    kv.append(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2), torch.tensor([[2, 3, 4]]))
    step = torch.tensor([0.9, 0.6, 0.8, 0.5, 0.2]).view(1, 1, 5)
    wkv.observe(0, kv, AttentionStats(step_attention=step, num_queries=torch.tensor([3])))
    assert kv.state[OBSERVED][0, 0, :5].tolist() == [5.0, 4.0, 3.0, 2.0, 1.0]
    assert kv.state[ACCUMULATED][0, 0, :5].tolist() == pytest.approx([2.4, 1.1, 0.8, 0.5, 0.2])


def test_prefill_merges_match_the_sequential_loop_on_random_rows_with_ties():
    # merge_in_order (prefill, no per-token loop) against merge_into_right (the merges one at a time):
    # scores drawn from 4 levels (many ties, zeros), rows of random lengths and merge counts.
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        B, H, T, D = 2, 3, int(torch.randint(2, 48, (), generator=g)), 4
        values = torch.randn(B, H, T, D, generator=g)
        average = torch.randint(0, 4, (B, H, T), generator=g).float() / 4
        order = torch.sort(average[..., :-1], dim=-1, stable=True).indices  # the newest slot never merges away
        order = torch.cat([order, torch.full((B, H, 1), T - 1)], dim=-1)
        count = torch.randint(0, T, (B, H), generator=g)
        loop, loop_alive = merge_into_right(values, average, order, count)
        vectorised, alive = merge_in_order(values, average, order, count)
        assert torch.equal(alive, loop_alive)
        assert torch.allclose(vectorised[alive], loop[alive], atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_prefill_runs_at_64k_tokens_per_row():
    T, keep = 65536, 13107
    kv = LayerKV.from_dense(torch.randn(1, 2, T, 8), torch.randn(1, 2, T, 8))
    stats = AttentionStats(column_sums=torch.rand(1, 2, T), num_queries=torch.tensor([T]))
    out = WeightedKV().compress(0, kv, stats, torch.tensor([keep]), "prefill")
    assert (out.lengths == keep).all() and torch.isfinite(out.values).all()


def test_default_recent_window_is_half_the_budget_minus_sinks():
    # m = 8, sinks 4 -> recent 0 -> at least 1; region = [4, len - 1): the newest slot never merges away.
    kv = one_hot_row(9)
    kv.state[ACCUMULATED] = torch.tensor([0.0, 0, 0, 0, 0.5, 0.5, 0.5, 0.5, 0.0]).view(1, 1, 9)
    kv.state[OBSERVED] = torch.ones(1, 1, 9)
    out = WeightedKV().compress(0, kv, AttentionStats(), torch.tensor([8]), "decode")
    assert out.positions[0, 0].tolist() == [0, 1, 2, 3, 5, 6, 7, 8]  # slot 4 (first of the ties) merged


def test_bad_config_names_the_value():
    with pytest.raises(ConfigError, match="recent=-1"):
        WeightedKV(recent=-1)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 24), st.integers(1, 24), st.integers(0, 4),
       st.sampled_from([None, 0, 3]), st.integers(0, 10_000))
def test_properties(B, H, T, keep, sinks, recent, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, T, 4, generator=g)
    stats = AttentionStats(column_sums=torch.rand(B, H, T, generator=g) * (torch.rand(B, H, T, generator=g) > 0.3))
    wkv = WeightedKV(sinks=sinks, recent=recent)
    const = torch.full((B, H, T, 4), -2.0)
    out = wkv.compress(0, LayerKV.from_dense(keys, const), stats, torch.full((B,), keep), "prefill")
    again = wkv.compress(0, LayerKV.from_dense(keys, const), stats, torch.full((B,), keep), "prefill")
    assert (out.lengths == min(keep, T)).all()
    assert out.keys.shape[2] == out.values.shape[2] == out.positions.shape[2] == int(out.lengths.max())
    assert torch.isfinite(out.values).all()
    assert torch.equal(out.values, again.values) and torch.equal(out.positions, again.positions)
    assert torch.allclose(out.values[out.valid()], torch.tensor(-2.0))  # convex merges keep a constant
    # keys are never merged, and the newest slot always survives
    assert torch.equal(out.keys, keys.gather(2, out.positions.unsqueeze(-1).expand(-1, -1, -1, 4)))
    last = out.positions.gather(2, (out.lengths - 1).unsqueeze(-1))
    assert (last == T - 1).all()
