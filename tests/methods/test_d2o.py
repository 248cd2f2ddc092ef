"""D2O: EMA threshold over three steps, GAT-style and code-mean merges, layer budgets, properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.errors import ConfigError
from kvbench.kernels.attention_stats import ragged_attention
from kvbench.kv import AttentionStats, LayerKV
from kvbench.methods.d2o import ALLOCATIONS, D2O, THRESHOLD, allocate

E = math.e


def row(keys: list[tuple[float, float]], values: list[float]) -> LayerKV:
    """One row, D = 2 (LayerKV needs equal key and value widths): value v is stored as (v, 0)."""
    v = torch.tensor(values).view(1, 1, -1, 1)
    return LayerKV.from_dense(torch.tensor(keys).view(1, 1, -1, 2), torch.cat([v, torch.zeros_like(v)], -1))


def decode_step(d2o: D2O, kv: LayerKV, key, value: float, position: int, step: list[float]) -> LayerKV:
    kv.append(torch.tensor(key).view(1, 1, 1, 2), torch.tensor([value, 0.0]).view(1, 1, 1, 2),
              torch.tensor([[position]]))
    d2o.observe(0, kv, AttentionStats(step_attention=torch.tensor(step).view(1, 1, -1)))
    return d2o.compress(0, kv, AttentionStats(), torch.tensor([2]), "decode")


def test_ema_threshold_and_weighted_merge_over_three_steps():
    # budget 2 = 1 heavy + 1 recent (N:M = 1:1), no sinks.
    d2o = D2O(n_heavy=1, n_recent=1, n_sinks=0, beta=0.7)
    kv = row([(1, 0), (0.6, 0.8), (0.96, 0.28), (0, 1)], [1.0, 2.0, 3.0, 4.0])
    stats = AttentionStats(column_sums=torch.tensor([5.0, 0.0, 0.0, 1.0]).view(1, 1, 4), num_queries=torch.tensor([4]))
    kv = d2o.compress(0, kv, stats, torch.tensor([2]), "prefill")
    # Step 1 (prompt): kept slots 0 (heavy) and 3 (recent); u = 0.8 (slot 1 -> slot 3), 0.96 (slot 2 -> slot 0).
    # tau_1 = mean = 0.88: slot 2 merges into slot 0, slot 1 is discarded.
    z = E + math.exp(0.96)
    k0 = ((E * 1 + math.exp(0.96) * 0.96) / z, (math.exp(0.96) * 0.28) / z)
    assert kv.positions[0, 0].tolist() == [0, 3]
    assert kv.state[THRESHOLD][0, 0, 0].item() == pytest.approx(0.88)
    assert kv.keys[0, 0, 0].tolist() == pytest.approx(k0, abs=1e-6)
    assert kv.values[0, 0, :, 0].tolist() == pytest.approx([(E * 1 + math.exp(0.96) * 3) / z, 4.0], abs=1e-6)
    # Step 2: new slot 4 key (0, 1); slot 3 is evicted (score 1 < 5), u = cos((0,1),(0,1)) = 1.
    # tau_2 = 0.7 * 1 + 0.3 * 0.88 = 0.964 <= 1: merged, e^1 / (e^1 + e^1) = 1/2 each.
    kv = decode_step(d2o, kv, (0, 1), 6.0, 4, [0.0, 0.0, 0.5])
    assert kv.positions[0, 0].tolist() == [0, 4]
    assert kv.state[THRESHOLD][0, 0, 0].item() == pytest.approx(0.964)
    assert kv.values[0, 0, :, 0].tolist() == pytest.approx([(E * 1 + math.exp(0.96) * 3) / z, 5.0], abs=1e-6)
    # Step 3: new slot 5 key (0.6, 0.8); slot 4 is evicted, its best match is slot 5 (0.8 > cos to merged k0 ~ 0.139).
    # tau_3 = 0.7 * 0.8 + 0.3 * 0.964 = 0.8492 > 0.8: discarded.
    kv = decode_step(d2o, kv, (0.6, 0.8), 7.0, 5, [0.0, 0.0, 0.5])
    assert kv.positions[0, 0].tolist() == [0, 5]
    assert kv.state[THRESHOLD][0, 0, 0].item() == pytest.approx(0.8492)
    assert kv.values[0, 0, 1, 0].item() == 7.0 and kv.keys[0, 0, 1].tolist() == pytest.approx([0.6, 0.8])


def test_code_mean_merge_rule():
    d2o = D2O(n_heavy=1, n_recent=1, n_sinks=0, merge_rule="code_mean")
    kv = row([(1, 0), (0.96, 0.28), (0, 1)], [1.0, 3.0, 4.0])
    stats = AttentionStats(column_sums=torch.tensor([5.0, 0.0, 1.0]).view(1, 1, 3), num_queries=torch.tensor([3]))
    out = d2o.compress(0, kv, stats, torch.tensor([2]), "prefill")
    # single evicted slot: tau = u = 0.96, merged: (k_c + u k_e) / 2
    assert out.keys[0, 0, 0].tolist() == pytest.approx([(1 + 0.96 * 0.96) / 2, 0.96 * 0.28 / 2], abs=1e-6)
    assert out.values[0, 0, 0, 0].item() == pytest.approx((1 + 0.96 * 3) / 2)


def test_layer_threshold_scope_shares_one_threshold():
    d2o = D2O(n_heavy=1, n_recent=1, n_sinks=0, threshold_scope="layer")
    keys = torch.tensor([[(1, 0), (0.6, 0.8), (0, 1)], [(1, 0), (1, 0), (0, 1)]]).view(1, 2, 3, 2)
    kv = LayerKV.from_dense(keys, torch.ones(1, 2, 3, 2))
    stats = AttentionStats(column_sums=torch.tensor([5.0, 0.0, 1.0]).expand(1, 2, 3), num_queries=torch.tensor([3]))
    out = d2o.compress(0, kv, stats, torch.tensor([2]), "prefill")
    # head 0: u = 0.8; head 1: u = 1 -> shared tau = 0.9: head 0 drops its token, head 1 merges.
    assert out.state[THRESHOLD][0, :, 0].tolist() == pytest.approx([0.9, 0.9])
    assert out.keys[0, 0, 0].tolist() == [1.0, 0.0]


def column_sums_with_variances(variances: list[float], T: int = 40) -> torch.Tensor:
    """(1, H, T) rows 1 -+ s alternating: population variance s^2."""
    signs = torch.tensor([-1.0, 1.0]).repeat(T // 2)
    return torch.stack([1 + math.sqrt(v) * signs for v in variances]).unsqueeze(0)


def prompt_stats(variances: list[float]) -> AttentionStats:
    """MHA: every query head is its own KV head, so the per-query-head sums are the column sums."""
    sums = column_sums_with_variances(variances)
    return AttentionStats(column_sums=sums, query_column_sums=sums, num_queries=torch.tensor([40]))


def test_inverse_variance_softmax_budgets():
    stats = [prompt_stats(v) for v in ([0.0, 1.0, 3.0], [0.0, 2.0, 2.0])]
    # min-max over heads: D_0 = (0 + 1/3 + 1) / 3 = 4/9, D_1 = (0 + 1 + 1) / 3 = 2/3.
    lam0 = 1 / (1 + math.exp(-(2 / 3 - 4 / 9)))  # softmax(-D)_0 = 0.5553
    budgets = D2O().layer_budgets(torch.tensor([10]), 2, stats, 0)
    assert lam0 * 20 == pytest.approx(11.107, abs=1e-3)
    assert budgets[:, 0].tolist() == [11, 9]
    uniform = D2O(allocation="uniform").layer_budgets(torch.tensor([10]), 2, stats, 0)
    assert uniform[:, 0].tolist() == [10, 10]
    # reciprocal: mean variance 4/3 and 4/3 -> equal
    reciprocal = D2O(allocation="reciprocal_variance").layer_budgets(torch.tensor([10]), 2, stats, 0)
    assert reciprocal[:, 0].tolist() == [10, 10]


def test_higher_attention_variance_gets_a_smaller_layer_budget():
    # 4 query heads in 2 GQA groups (2 KV heads), 100 prompt tokens; a query head's column sums are either
    # uniform (all 1, variance 0) or a sink (100 on slot 0, 0 elsewhere, unbiased variance 100).
    # Layer 0: uniform, uniform, uniform, sink -> min-max (0, 0, 0, 1), D_0 = 1/4.
    # Layer 1: uniform, sink, sink, sink -> (0, 1, 1, 1), D_1 = 3/4: more attention variance -> less cache.
    # lambda = softmax(-D) = (0.6225, 0.3775); total 2 x 20 -> 24.9, 15.1 -> (25, 15).
    uniform, sink = torch.ones(100), torch.zeros(100)
    sink[0] = 100.0

    def layer(heads):
        per_query = torch.stack(heads).unsqueeze(0)  # (1, 4, 100)
        per_kv = per_query.view(1, 2, 2, 100).mean(2)  # what the GQA-averaged statistic sees
        return AttentionStats(column_sums=per_kv, query_column_sums=per_query, num_queries=torch.tensor([100]))

    stats = [layer([uniform, uniform, uniform, sink]), layer([uniform, sink, sink, sink])]
    assert D2O().layer_budgets(torch.tensor([20]), 2, stats, 0)[:, 0].tolist() == [25, 15]
    # (averaged over each GQA group the two layers look alike: min-max (0, 1) in both, equal budgets)


def test_query_column_sums_keep_every_query_head():
    # One KV head, two query heads; keys k0 = (0, 0), k1 = (1, 0), queries at positions 0 and 1, scaling 1.
    # Query head 0 = (ln 3, 0): its second query sees logits (0, ln 3) -> (1/4, 3/4); head 1 = 0: (1/2, 1/2).
    # Both first queries see only k0. Column sums per query head: (1.25, 0.75) and (1.5, 0.5).
    query = torch.tensor([[math.log(3), 0.0], [math.log(3), 0.0]]).view(1, 1, 2, 2)
    query = torch.cat([query, torch.zeros(1, 1, 2, 2)], dim=1)
    keys = torch.tensor([[0.0, 0.0], [1.0, 0.0]]).view(1, 1, 2, 2)
    _, stats = ragged_attention(query, keys, None, torch.ones(1, 1, 2, dtype=torch.bool), torch.tensor([[[0, 1]]]),
                                torch.tensor([[0, 1]]), 1.0, want_column_sums=True, want_query_column_sums=True)
    torch.testing.assert_close(stats["query_column_sums"], torch.tensor([[[1.25, 0.75], [1.5, 0.5]]]))
    torch.testing.assert_close(stats["column_sums"], torch.tensor([[[1.375, 0.625]]]))  # the group's mean


def test_engine_hands_d2o_per_query_head_sums(tiny_model):
    seen, handed, compressed_with = [], [], []

    class Recording(D2O):
        def budget_statistic(self, stats):  # the engine's call right after each layer's attention
            seen.append((stats.query_column_sums, stats.column_sums))
            return super().budget_statistic(stats)

        def layer_budgets(self, n_keep, num_layers, prefill_stats, max_new_tokens):
            handed.append(prefill_stats)
            return super().layer_budgets(n_keep, num_layers, prefill_stats, max_new_tokens)

        def compress(self, layer, kv, stats, n_keep, phase, host=None):
            if phase == "prefill":  # the per-query-head sums were dropped once their variances were taken
                compressed_with.append((stats.query_column_sums, stats.column_sums))
            return super().compress(layer, kv, stats, n_keep, phase, host)

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (30, 21)]  # ragged: left padding
    Engine(tiny_model, Recording(), Budget("fraction", 0.5)).prefill(prompts, max_new_tokens=2)
    group = tiny_model.config.num_attention_heads // tiny_model.config.num_key_value_heads
    lengths = set()
    for query_sums, sums in seen:  # the engine prefills one row at a time: one (B = 1) statistics a row and layer
        B, Hq, T = query_sums.shape
        assert B == 1 and Hq == tiny_model.config.num_attention_heads
        lengths.add(T)
        # every query spreads one unit over the slots of its row
        torch.testing.assert_close(query_sums.sum(-1), torch.full((1, Hq), float(T)))
        torch.testing.assert_close(query_sums.view(B, -1, group, T).mean(2), sums)
    assert lengths == {30, 21} and len(seen) == 2 * tiny_model.config.num_hidden_layers
    # layer_budgets gets the statistics taken in the pass, on the host, with the prompt's length
    for stats, n in zip(handed, (30, 21)):
        assert len(stats) == tiny_model.config.num_hidden_layers
        for layer in stats:
            assert layer.budget_statistic.shape == (1, Hq) and layer.num_queries.tolist() == [n]
            assert layer.query_column_sums is None and layer.column_sums is None
    assert len(compressed_with) == 2 * tiny_model.config.num_hidden_layers
    assert all(query_sums is None and sums is not None for query_sums, sums in compressed_with)


def test_budgets_from_the_statistics_taken_in_the_pass_equal_those_from_the_whole_statistics(tiny_model):
    # the engine's budgets (each layer's statistic taken after its attention) against layer_budgets on the
    # pass's own statistics, kept whole by a method that takes no statistic
    class Whole(D2O):
        def budget_statistic(self, stats):
            return None

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 200, (128,), generator=g).tolist()
    for allocation in ALLOCATIONS:
        taken, whole = (Engine(tiny_model, cls(allocation=allocation), Budget("fraction", 0.3)).prefill_row(
            prompt, max_new_tokens=2) for cls in (D2O, Whole))
        assert taken.host_n_keep.tolist() == whole.host_n_keep.tolist()
        if allocation == "inverse_variance_softmax":  # budgets the variances set: the two layers' differ
            assert taken.host_n_keep[:, 0].tolist() == [35, 41]


def test_recent_share_is_floored_as_in_the_code():
    # budget 6, N:M = 3:1: recent = floor(6 / 4) = 1 (slot 9), heavy = 5 top scores among 0..8 (slots 0..4).
    kv = row([(1.0, 0.0)] * 10, [float(j) for j in range(10)])
    scores = AttentionStats(column_sums=torch.arange(9.0, -1.0, -1.0).view(1, 1, 10), num_queries=torch.tensor([10]))
    out = D2O(n_sinks=0).compress(0, kv, scores, torch.tensor([6]), "prefill")
    assert out.positions[0, 0].tolist() == [0, 1, 2, 3, 4, 9]


def test_protected_layers_count_inside_the_total():
    stats = [prompt_stats([0.0, 1.0])] * 3
    budgets = D2O(allocation="uniform", protect_layers=[0]).layer_budgets(torch.tensor([20]), 3, stats, 0)
    assert budgets[:, 0].tolist() == [40, 10, 10]
    with pytest.raises(ConfigError, match="protect_layers"):
        D2O(protect_layers=[0]).layer_budgets(torch.tensor([10]), 3, stats, 0)
    with pytest.raises(ConfigError, match=r"\[5\]"):
        D2O(protect_layers=[5]).layer_budgets(torch.tensor([20]), 3, stats, 0)


def test_allocate_clamps_and_keeps_the_total():
    assert allocate(torch.tensor([1.0, 100.0]), 20, 2, 15).tolist() == [5, 15]
    assert allocate(torch.tensor([1.0, 1.0, 1.0]), 10, 1, 40).tolist() == [4, 3, 3]
    assert allocate(torch.tensor([1e-9, 1.0]), 20, 3, 40).tolist() == [3, 17]


def test_bad_config_names_the_value():
    with pytest.raises(ConfigError, match="allocation 'pyramid'"):
        D2O(allocation="pyramid")
    with pytest.raises(ConfigError, match="beta=1.5"):
        D2O(beta=1.5)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 24), st.integers(1, 24),
       st.sampled_from(["weighted", "code_mean"]), st.sampled_from(["head", "layer"]), st.integers(0, 10_000))
def test_properties(B, H, T, keep, rule, scope, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, T, 4, generator=g)
    stats = AttentionStats(column_sums=torch.rand(B, H, T, generator=g), num_queries=torch.full((B,), T))
    d2o = D2O(merge_rule=rule, threshold_scope=scope)
    const = torch.full((B, H, T, 4), 3.0)
    out = d2o.compress(0, LayerKV.from_dense(keys, const), stats, torch.full((B,), keep), "prefill")
    again = d2o.compress(0, LayerKV.from_dense(keys, const), stats, torch.full((B,), keep), "prefill")
    assert (out.lengths == min(keep, T)).all()
    assert out.keys.shape[2] == out.values.shape[2] == out.positions.shape[2] == int(out.lengths.max())
    assert torch.isfinite(out.keys).all() and torch.isfinite(out.values).all()
    assert torch.equal(out.keys, again.keys) and torch.equal(out.values, again.values)
    if rule == "weighted":  # convex weights: a constant value stays constant
        real = out.valid()
        assert torch.allclose(out.values[real], torch.tensor(3.0))
