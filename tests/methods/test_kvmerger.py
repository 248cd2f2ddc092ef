"""KVMerger: merging sets, protection, Gaussian-kernel weights, budget rule; hand-built caches.

Expected values are worked out by hand in the comments; the property tests compare the vectorised method
with a plain-Python transcription of Algorithm 1 (protected set + right-to-left runs).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.errors import ConfigError
from kvbench.kernels.attention_stats import ragged_attention
from kvbench.kernels.similarity import adjacent_cosine, anchor_runs, chain_runs
from kvbench.kv import LOGIT_BIAS, AttentionStats, LayerKV
from kvbench.methods.kvmerger import KVMerger, budget_ratios


def cache(keys: list[list[float]], values: list[list[float]] | None = None) -> LayerKV:
    """One row (B = H = 1) from per-slot key (and value) lists."""
    k = torch.tensor(keys, dtype=torch.float32).view(1, 1, len(keys), -1)
    v = k.clone() if values is None else torch.tensor(values, dtype=torch.float32).view(1, 1, len(values), -1)
    return LayerKV.from_dense(k, v)


def stats(scores: list[float]) -> AttentionStats:
    return AttentionStats(column_sums=torch.tensor(scores).view(1, 1, -1))


NO_PROTECTION = dict(recent_ratio=0.0, heavy_ratio=0.0)


def test_identical_adjacent_keys_collapse_into_one_set():
    # 6 identical keys, nothing protected: one set, every g = 1, w = 1/6; pivot = slot 2 (largest score).
    kv = cache([[1.0, 2.0]] * 6, [[float(j), 0.0] for j in range(6)])
    out = KVMerger(**NO_PROTECTION).compress(0, kv, stats([0.1, 0.5, 0.9, 0.2, 0.3, 0.4]), torch.tensor([3]), "prefill")
    assert out.lengths.tolist() == [[1]]
    assert out.positions[0, 0].tolist() == [2]
    torch.testing.assert_close(out.keys[0, 0, 0], torch.tensor([1.0, 2.0]))
    # v = |S| * sum w_j v_j = 6 * (0+1+2+3+4+5)/6 = 15
    torch.testing.assert_close(out.values[0, 0, 0], torch.tensor([15.0, 0.0]))


def test_protected_tokens_break_runs():
    # 10 identical keys; recent = ceil(0.1*10) = 1 (slot 9); heavy = 1: slot 4 has the top score among 0..8.
    # Runs: {0..3} (pivot 1), {4}, {5..8} (pivot 8), {9}.
    scores = [0.1, 0.3, 0.2, 0.1, 5.0, 0.1, 0.1, 0.2, 0.4, 9.0]
    kv = cache([[1.0, 1.0]] * 10, [[1.0, 0.0]] * 10)
    out = KVMerger(recent_ratio=0.1, heavy_ratio=0.1).compress(0, kv, stats(scores), torch.tensor([5]), "prefill")
    assert out.positions[0, 0].tolist() == [1, 4, 8, 9]
    # values: each set of size s gives s * (1, 0); protected singletons unchanged.
    torch.testing.assert_close(out.values[0, 0, :, 0], torch.tensor([4.0, 1.0, 4.0, 1.0]))


@pytest.mark.parametrize("n_keep, expected", [
    # 35%: recent ceil(0.08 * 100) = 8 (92..99), heavy ceil(0.02 * 100) = 2 (scores = slot: 90, 91); the
    # identical keys 0..89 form one set, pivot 89 (the top score) -> 11 slots.
    (35, [89, *range(90, 100)]),
    # 50%: recent 17 (83..99), heavy 12 (71..82); slots 0..70 one set, pivot 70 -> 30 slots.
    (50, list(range(70, 100))),
])
def test_protected_ratios_follow_the_budget_as_in_the_paper(n_keep, expected):
    kv = cache([[1.0, 1.0]] * 100)
    out = KVMerger().compress(0, kv, stats([float(j) for j in range(100)]), torch.tensor([n_keep]), "prefill")
    assert out.positions[0, 0].tolist() == expected


def test_budget_ratios_between_and_beyond_the_papers_two_settings():
    recent, heavy = budget_ratios(torch.tensor([0.2, 0.35, 0.425, 0.5, 0.75, 1.0, 2.0]))
    # below 35%: the 35% setting scaled; between: linear; above 50%: the same line continued; above 1: as 1
    torch.testing.assert_close(recent, torch.tensor([0.08 * 0.2 / 0.35, 0.08, 0.125, 0.17, 0.32, 0.47, 0.47],
                                                    dtype=torch.float64))
    torch.testing.assert_close(heavy, torch.tensor([0.02 * 0.2 / 0.35, 0.02, 0.07, 0.12, 0.12 + 0.25 * 2 / 3,
                                                    0.12 + 0.5 * 2 / 3, 0.12 + 0.5 * 2 / 3], dtype=torch.float64))


def test_fixed_ratios_ignore_the_budget():
    kv = cache([[1.0, 1.0]] * 100)
    scores = stats([float(j) for j in range(100)])
    method = KVMerger(recent_ratio=0.17, heavy_ratio=0.12)
    assert method.compress(0, kv, scores, torch.tensor([35]), "prefill").positions[0, 0].tolist() == list(range(70, 100))


THREE = [[3.0, 0.0], [3.0, 1.0], [4.0, 0.0]]  # adjacent cosines 3/sqrt(10) = 0.949 and 12/(4 sqrt(10)) = 0.949
THREE_VALUES = [[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]
THREE_SCORES = [0.1, 0.9, 0.2]  # pivot = slot 1, key (3, 1); squared distances to it: 1, 0, 2


def test_gaussian_weights_three_token_set_fixed_sigma():
    # sigma = 1: g = exp(-d^2 / 2) = (e^-0.5, 1, e^-1)
    g = [math.exp(-0.5), 1.0, math.exp(-1.0)]
    w = [x / sum(g) for x in g]
    out = KVMerger(sigma=1.0, **NO_PROTECTION).compress(0, cache(THREE, THREE_VALUES), stats(THREE_SCORES),
                                                        torch.tensor([1]), "prefill")
    assert out.lengths.tolist() == [[1]] and out.positions[0, 0].tolist() == [1]
    # k = w0 (3,0) + w1 (3,1) + w2 (4,0) = (3 + w2, w1); v = 3 * (w0, w1)
    torch.testing.assert_close(out.keys[0, 0, 0], torch.tensor([3 + w[2], w[1]]))
    torch.testing.assert_close(out.values[0, 0, 0], torch.tensor([3 * w[0], 3 * w[1]]))


def test_gaussian_weights_adaptive_sigma_and_no_value_scaling():
    # distances (1, 0, sqrt 2), mean m = (1 + sqrt 2)/3, 2 sigma^2 = m^2: g = (e^{-1/m^2}, 1, e^{-2/m^2})
    m = (1 + math.sqrt(2)) / 3
    g = [math.exp(-1 / m**2), 1.0, math.exp(-2 / m**2)]
    w = [x / sum(g) for x in g]
    method = KVMerger(value_scaling="none", **NO_PROTECTION)
    out = method.compress(0, cache(THREE, THREE_VALUES), stats(THREE_SCORES), torch.tensor([1]), "prefill")
    torch.testing.assert_close(out.keys[0, 0, 0], torch.tensor([3 + w[2], w[1]]))
    torch.testing.assert_close(out.values[0, 0, 0], torch.tensor([w[0], w[1]]))


def test_proportional_value_scaling_keeps_the_convex_average_and_adds_log_set_size():
    # the fixed-sigma case above: same key, value = w0 (1,0) + w1 (0,1) without the factor 3, bias log 3
    g = [math.exp(-0.5), 1.0, math.exp(-1.0)]
    w = [x / sum(g) for x in g]
    method = KVMerger(sigma=1.0, value_scaling="proportional", **NO_PROTECTION)
    out = method.compress(0, cache(THREE, THREE_VALUES), stats(THREE_SCORES), torch.tensor([1]), "prefill")
    torch.testing.assert_close(out.keys[0, 0, 0], torch.tensor([3 + w[2], w[1]]))
    torch.testing.assert_close(out.values[0, 0, 0], torch.tensor([w[0], w[1]]))
    torch.testing.assert_close(out.state[LOGIT_BIAS], torch.tensor([[[math.log(3.0)]]]))
    # sets {0..3}, {4}, {5}, {6..8}, {9} of the protection case: bias log 4 on the merged sets, 0 on singletons
    scores = [0.1, 0.3, 0.2, 0.1, 5.0, 0.1, 0.1, 0.2, 0.4, 9.0]
    kv = cache([[1.0, 1.0]] * 10, [[1.0, 0.0]] * 10)
    kv.keys[0, 0, 5] = torch.tensor([1.0, -1.0])  # orthogonal to its neighbours: a set of its own
    method = KVMerger(recent_ratio=0.1, heavy_ratio=0.1, value_scaling="proportional")
    out = method.compress(0, kv, stats(scores), torch.tensor([5]), "prefill")
    assert out.positions[0, 0].tolist() == [1, 4, 5, 8, 9]
    torch.testing.assert_close(out.state[LOGIT_BIAS][0, 0], torch.tensor([math.log(4), 0, 0, math.log(3), 0]))
    torch.testing.assert_close(out.values[0, 0, :, 0], torch.ones(5))
    assert LOGIT_BIAS not in KVMerger(**NO_PROTECTION).compress(0, kv, stats(scores), torch.tensor([5]),
                                                                "prefill").state


def test_proportional_merge_of_identical_keys_attends_like_the_set():
    # keys k k k k a b (a, b orthogonal to k and each other): sets {0..3}, {4}, {5}; every g = 1 in the first,
    # so w = 1/4 and |S| e^{q.k} mean(v) = sum over the set of e^{q.k} v_j: attention is unchanged.
    keys = [[1.0, 0.0, 0.0]] * 4 + [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    gen = torch.Generator().manual_seed(2)
    values = torch.randn(6, 3, generator=gen).tolist()
    kv = cache(keys, values)
    query, query_pos = torch.randn(1, 1, 1, 3, generator=gen), torch.tensor([[9]])
    dense, _ = ragged_attention(query, kv.keys, kv.values, kv.valid(), kv.positions, query_pos, 1.0)
    results = {}
    for scaling in ("proportional", "set_size"):
        out = KVMerger(value_scaling=scaling, **NO_PROTECTION).compress(0, kv, stats([1.0] * 6), torch.tensor([3]),
                                                                        "prefill")
        assert out.positions.tolist() == [[[0, 4, 5]]]
        results[scaling], _ = ragged_attention(query, out.keys, out.values, out.valid(), out.positions, query_pos,
                                               1.0, key_bias=out.state.get(LOGIT_BIAS))
    torch.testing.assert_close(results["proportional"], dense)
    assert not torch.allclose(results["set_size"], dense)  # one share with a 4x value is not the same


def test_chain_and_anchor_grouping_differ_on_a_slow_rotation():
    # keys at 0, 30, 60 degrees: adjacent cosines 0.866 > 0.75 (chain: one set), but the anchor (60 deg) vs
    # 0 deg is 0.5 < 0.75 (anchor: {0}, {1, 2}).
    angles = [0.0, math.pi / 6, math.pi / 3]
    kv = cache([[math.cos(a), math.sin(a)] for a in angles])
    mergeable = torch.ones(1, 1, 3, dtype=torch.bool)
    chain = chain_runs(adjacent_cosine(kv.keys), mergeable, kv.lengths, 0.75)
    anchor = anchor_runs(kv.keys, mergeable, kv.lengths, 0.75)
    assert chain.tolist() == [[[0, 0, 0]]]
    assert anchor.tolist() == [[[0, 1, 1]]]
    out = KVMerger(grouping="anchor", **NO_PROTECTION).compress(0, kv, stats([1.0, 0.0, 2.0]), torch.tensor([1]),
                                                                "prefill")
    assert out.positions[0, 0].tolist() == [0, 2]


def test_enforce_budget_keeps_protected_and_best_sets():
    # orthogonal keys: no merging; recent = slot 5, heavy = slot 2 (score 0.9); n_keep = 3 keeps them plus the
    # best remaining score (slot 0, 0.5).
    keys = [[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0], [1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0]]
    method = KVMerger(recent_ratio=0.1, heavy_ratio=0.1, enforce_budget=True)
    out = method.compress(0, cache(keys), stats([0.5, 0.1, 0.9, 0.2, 0.3, 0.0]), torch.tensor([3]), "prefill")
    assert out.positions[0, 0].tolist() == [0, 2, 5]


@pytest.mark.parametrize("bad", [dict(grouping="tree"), dict(sigma="auto"), dict(sigma=0), dict(epsilon=2.0),
                                 dict(value_scaling="sqrt"), dict(recent_ratio=1.5)])
def test_bad_config_names_the_value(bad):
    with pytest.raises(ConfigError, match=str(list(bad.values())[0])):
        KVMerger(**bad)


# -- properties ---------------------------------------------------------------------------------------------

def reference_lengths(keys: torch.Tensor, scores: torch.Tensor, length: int, method: KVMerger) -> int:
    """Plain-Python Algorithm 1 on one row: protected set, then right-to-left chain runs among the rest."""
    n_recent = math.ceil(round(method.recent_ratio * length, 9))
    n_heavy = math.ceil(round(method.heavy_ratio * length, 9))
    recent = set(range(length - n_recent, length))
    others = sorted((j for j in range(length) if j not in recent), key=lambda j: (-float(scores[j]), j))
    protected = recent | set(others[:n_heavy])
    cos = lambda a, b: float(torch.nn.functional.cosine_similarity(keys[a], keys[b], dim=0, eps=1e-12))
    sets, i = 0, length - 1
    while i >= 0:
        sets += 1
        j = i - 1
        while i not in protected and j >= 0 and j not in protected and cos(j + 1, j) > method.epsilon:
            j -= 1
        i = j
    return sets


rows = st.tuples(st.integers(1, 3), st.integers(1, 2), st.integers(1, 24), st.integers(0, 2**16))


@settings(max_examples=40, deadline=None)
@given(rows, st.sampled_from([0.0, 0.1, 0.17]), st.sampled_from([0.0, 0.12, 0.3]), st.sampled_from([-0.2, 0.3, 0.75]),
       st.sampled_from(["adaptive", 0.5, 5.0]))
def test_kvmerger_properties(shape, recent_ratio, heavy_ratio, epsilon, sigma):
    B, H, T, seed = shape
    gen = torch.Generator().manual_seed(seed)
    # few distinct directions so that runs of similar keys actually occur
    base = torch.randn(3, 4, generator=gen)
    keys = base[torch.randint(0, 3, (B, H, T), generator=gen)] + 0.3 * torch.randn(B, H, T, 4, generator=gen)
    kv = LayerKV.from_dense(keys, torch.randn(B, H, T, 4, generator=gen))
    kv.lengths = torch.randint(1, T + 1, (B, H), generator=gen)
    kv.zero_padding()
    scores = torch.rand(B, H, T, generator=gen) * kv.valid()
    method = KVMerger(epsilon=epsilon, recent_ratio=recent_ratio, heavy_ratio=heavy_ratio, sigma=sigma)
    out = method.compress(0, kv, AttentionStats(column_sums=scores), torch.ones(B, dtype=torch.long), "prefill")
    again = method.compress(0, kv, AttentionStats(column_sums=scores), torch.ones(B, dtype=torch.long), "prefill")
    for b in range(B):
        for h in range(H):
            n = int(kv.lengths[b, h])
            assert int(out.lengths[b, h]) == reference_lengths(kv.keys[b, h], scores[b, h], n, method)
            pos = out.positions[b, h, : out.lengths[b, h]]
            assert bool((pos[1:] > pos[:-1]).all()) and int(pos.min()) >= 0 and int(pos.max()) < n
    assert out.keys.shape[:3] == out.values.shape[:3] == out.positions.shape
    assert out.keys.shape[2] == int(out.lengths.max())
    assert bool(torch.isfinite(out.keys).all() and torch.isfinite(out.values).all())
    assert bool((out.positions[~out.valid()] == -1).all())
    assert torch.equal(out.keys, again.keys) and torch.equal(out.values, again.values)
    # weights of every set are convex
    groups = method.merging_sets(kv, kv.valid() & ~method.protected(scores, kv.lengths, kv.valid()))
    G = int(groups.max()) + 1
    weight, _ = method.gaussian_weights(kv.keys, groups, method.pivots(scores, groups, G), G)
    assert bool(((weight >= 0) & (weight <= 1 + 1e-6)).all())
    sums = torch.zeros(B, H, G).scatter_add_(2, groups.clamp(min=0), weight * (groups >= 0))
    real_sets = torch.arange(G).view(1, 1, -1) <= groups.amax(-1, keepdim=True)
    torch.testing.assert_close(sums[real_sets], torch.ones(int(real_sets.sum())))
