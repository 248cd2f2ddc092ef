"""EMS (kvbench/methods/ems.py): Global-Local score, evict-then-merge partition, zero class, weighted merge,
RoPE handling of merged keys, decode-time state and budget, and the engine end to end on the tiny model."""

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
from kvbench.kernels.decode_attention import decode_attention
from kvbench.kernels.redundancy import redundancy, rotate_like
from kvbench.kv import LOGIT_BIAS, AttentionStats, LayerKV
from kvbench.methods.ems import EMS, global_local_score


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Independent rotate_half RoPE for the tests: x (..., T, D), positions (..., T)."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    angle = positions.double().unsqueeze(-1) * inv_freq  # (..., T, half)
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x.double()[..., :half], x.double()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).to(x.dtype)


def one_row(keys, values, scores, raw_keys=None, positions=None):
    """A (1, 1, T) LayerKV and prefill stats where global == local scores (so Global-Local = the score)."""
    k = torch.tensor(keys, dtype=torch.float32).view(1, 1, len(keys), -1)
    v = torch.tensor(values, dtype=torch.float32).view(1, 1, len(values), -1)
    s = torch.tensor(scores, dtype=torch.float32).view(1, 1, -1)
    pos = None if positions is None else torch.tensor(positions).view(1, 1, -1)
    kv = LayerKV.from_dense(k, v, pos)
    raw = k if raw_keys is None else torch.tensor(raw_keys, dtype=torch.float32).view(1, 1, len(keys), -1)
    return kv, AttentionStats(column_sums=s, window_column_sums=s, raw_keys=raw)


# Slots 0..4, local window = slot 4; one centre (N_budget 2 - L_win 1); gamma 2 -> N_tbm = 2.
# Ranking of slots 0-3 by score: 1 (centre), 2 and 3 (TBM), 0 (Irr, evicted first).
KEYS = [[9.0, 9.0], [2.0, 0.0], [3.0, 3.0], [0.0, 1.0], [1.0, 1.0]]
VALUES = [[5.0, 5.0], [1.0, 0.0], [2.0, 0.5], [0.0, 1.0], [7.0, 7.0]]
SCORES = [0.1, 3.0, 1.0, 0.2, 0.7]
# R(slot 2, centre 1) = cos(k) * cos(v) = (1/sqrt 2) * (2/sqrt 4.25) = 0.686; R(slot 3, centre 1) = 0.


def test_global_local_score_literal():
    s_glo = torch.tensor([[[4.0, 2.0, 1.0, 1.0]]])  # mean 2
    s_loc = torch.tensor([[[0.5, 0.25, 1.0, 0.25]]])  # mean 0.5 -> alignment factor 0.25
    valid = torch.ones(1, 1, 4, dtype=torch.bool)
    # aligned global = [1, 0.5, 0.25, 0.25]; element-wise max with s_loc
    expected = torch.tensor([[[1.0, 0.5, 1.0, 0.25]]])
    assert torch.allclose(global_local_score(s_glo, s_loc, valid), expected)
    # padding slots neither count in the means nor get a score
    pad = torch.tensor([[[True, True, True, True, False]]])
    got = global_local_score(torch.cat([s_glo, torch.tensor([[[8.0]]])], -1),
                             torch.cat([s_loc, torch.tensor([[[8.0]]])], -1), pad)
    assert torch.allclose(got, torch.cat([expected, torch.zeros(1, 1, 1)], -1))


def test_weighted_merge_when_redundancy_reaches_tau():
    kv, stats = one_row(KEYS, VALUES, SCORES)
    out = EMS(window=1, kernel_size=1, tau=0.6, gamma=2, expansion="bias").compress(
        0, kv, stats, torch.tensor([2]), "prefill")
    assert out.lengths.tolist() == [[2]] and out.positions[0, 0].tolist() == [1, 4]
    # weights by score: centre 3/(3+1) = 0.75, TBM slot 2: 0.25; values merged as they are
    assert torch.allclose(out.values[0, 0], torch.tensor([[0.75 * 1 + 0.25 * 2, 0.25 * 0.5], [7.0, 7.0]]))
    # keys: unit directions merged and renormalised, times the weighted mean norm 0.75*2 + 0.25*3*sqrt(2)
    direction = torch.tensor([0.75 + 0.25 / math.sqrt(2), 0.25 / math.sqrt(2)])
    norm = 0.75 * 2 + 0.25 * 3 * math.sqrt(2)
    assert torch.allclose(out.keys[0, 0, 0], norm * direction / direction.norm(), atol=1e-6)
    assert torch.allclose(out.keys[0, 0, 0], torch.tensor([2.51531, 0.47979]), atol=1e-4)
    assert torch.equal(out.keys[0, 0, 1], torch.tensor([1.0, 1.0]))
    # the centre remembers the merged member's weight, and that it stands for 2 tokens: bias log 2
    assert torch.allclose(out.state["merged_mass"][0, 0], torch.tensor([1.0, 0.0]))
    assert out.state["merged_tokens"].tolist() == [[[1.0, 0.0]]]
    torch.testing.assert_close(out.state[LOGIT_BIAS], torch.tensor([[[math.log(2.0), 0.0]]]))
    plain = EMS(window=1, kernel_size=1, tau=0.6, gamma=2, multiplicity_bias=False, expansion="bias").compress(
        0, kv, stats, torch.tensor([2]), "prefill")
    assert LOGIT_BIAS not in plain.state and torch.equal(plain.keys, out.keys)
    assert plain.state["merged_tokens"].tolist() == [[[1.0, 0.0]]]


def test_multiplicity_bias_gives_a_cluster_of_identical_members_their_shares():
    # Slots 1 and 2 are identical (R = 1): one centre of 2 tokens (bias log 2). Slot 3 (R = 0) and slot 0 (Irr)
    # are evicted. Attention over the 2 entries then equals attention over the surviving tokens 1, 2, 4.
    keys = [[9.0, 9.0], [2.0, 0.0], [2.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
    values = [[5.0, 5.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [7.0, 7.0]]
    kv, stats = one_row(keys, values, SCORES)
    out = EMS(window=1, kernel_size=1, tau=0.6, gamma=2, expansion="bias").compress(
        0, kv, stats, torch.tensor([2]), "prefill")
    assert out.positions.tolist() == [[[1, 4]]]
    torch.testing.assert_close(out.state[LOGIT_BIAS], torch.tensor([[[math.log(2.0), 0.0]]]))
    query, query_pos = torch.tensor([[[[0.7, -0.3]]]]), torch.tensor([[9]])
    survivors = torch.tensor([[[False, True, True, False, True]]])
    dense, _ = ragged_attention(query, kv.keys, kv.values, survivors, kv.positions, query_pos, 1.0)
    merged, _ = ragged_attention(query, out.keys, out.values, out.valid(), out.positions, query_pos, 1.0,
                                 key_bias=out.state[LOGIT_BIAS])
    torch.testing.assert_close(merged, dense)
    # by hand: logits 1.4 (x2) and 0.4; output = (2 e^1.4 (1, 0) + e^0.4 (7, 7)) / (2 e^1.4 + e^0.4)
    a, b = 2 * math.exp(1.4), math.exp(0.4)
    torch.testing.assert_close(merged[0, 0, 0], torch.tensor([(a + 7 * b) / (a + b), 7 * b / (a + b)]))


def attend(kv: LayerKV, query: torch.Tensor, query_pos: torch.Tensor, expansion=None):
    """One decode query over a compressed row as the engine's attention reads it: the LUT expansion (if any)
    or the stored slots with their logit bias; returns (output, step attention folded onto stored slots)."""
    view = kv if expansion is None else expansion.kv
    out, step = decode_attention(query, view.keys, view.values, view.lengths, view.positions, query_pos, 1.0,
                                 view.capacity, want_step=True, key_bias=view.state.get(LOGIT_BIAS))
    if expansion is not None:
        step = expansion.fold({"step_attention": step}, kv.capacity)["step_attention"]
    return out, step


def test_lut_gives_a_cluster_the_sum_of_its_members_exps():
    # Slot 2 merges into centre 1 (weights 0.75 / 0.25, as above); w.o. pos, no RoPE in this 2-D example.
    # LUT: the centre is stored at its own norm 2 along the shared direction k_hat; member slot 2 is expanded
    # at attention time to its own norm 3 sqrt 2 along k_hat, with the cluster's value.
    kv, stats = one_row(KEYS, VALUES, SCORES)
    method = EMS(window=1, kernel_size=1, tau=0.6, gamma=2)
    out = method.compress(0, kv, stats, torch.tensor([2]), "prefill")
    direction = torch.tensor([0.75 + 0.25 / math.sqrt(2), 0.25 / math.sqrt(2)])
    k_hat = direction / direction.norm()
    torch.testing.assert_close(out.keys[0, 0, 0], 2 * k_hat)
    assert LOGIT_BIAS not in out.state
    # LUT size (gamma - 1) * N_budget = 2: member token 2 of centre token 1, norm 3 sqrt 2; one entry unused
    assert out.tables["lut_position"].tolist() == [[[2, -1]]] and out.tables["lut_centre"].tolist() == [[[1, -1]]]
    torch.testing.assert_close(out.tables["lut_norm"], torch.tensor([[[3 * math.sqrt(2), -1.0]]]))
    expansion = method.expand(0, out, rotate=None)
    assert expansion.kv.lengths.tolist() == [[3]] and expansion.kv.positions[0, 0].tolist() == [1, 4, 2, -1]
    query, query_pos = torch.tensor([[[[0.7, -0.3]]]]), torch.tensor([[9]])
    got, step = attend(out, query, query_pos, expansion)
    # by hand: logits l1 = 2 q.k_hat (centre), l2 = 3 sqrt 2 q.k_hat (member), l4 = q.(1, 1) = 0.4 (local);
    # the cluster's value (1.25, 0.125) takes e^l1 + e^l2 of the softmax mass
    qk = 0.7 * float(k_hat[0]) - 0.3 * float(k_hat[1])
    cluster, local = math.exp(2 * qk) + math.exp(3 * math.sqrt(2) * qk), math.exp(0.4)
    z = cluster + local
    torch.testing.assert_close(got[0, 0, 0], torch.tensor([(1.25 * cluster + 7 * local) / z,
                                                           (0.125 * cluster + 7 * local) / z]))
    torch.testing.assert_close(step[0, 0], torch.tensor([cluster / z, local / z]))  # the cluster's mass on it
    # the bias reading gives the cluster 2 e^(mean logit) instead: not the sum of its members' exps
    biased = EMS(window=1, kernel_size=1, tau=0.6, gamma=2, expansion="bias").compress(
        0, kv, stats, torch.tensor([2]), "prefill")
    got_bias, _ = attend(biased, query, query_pos)
    assert not torch.allclose(got_bias, got, atol=1e-3)


def test_lut_zero_class_is_masked():
    # Decode step: stored tokens 5, 6 (centres), 7 (leaves the window: window 1), 8 (new). The LUT holds
    # member 1 of centre 7 and member 2 of centre 5. Token 7 scores lowest: it is the TBM token.
    keys = [[1.0, 0.0], [0.0, 1.0], [1.0, 0.1], [5.0, 5.0]]
    values = [[1.0, 0.0], [0.0, 1.0], [3.0, 0.0], [5.0, 5.0]]
    kv = LayerKV.from_dense(torch.tensor(keys).view(1, 1, 4, 2), torch.tensor(values).view(1, 1, 4, 2),
                            torch.tensor([5, 6, 7, 8]).view(1, 1, 4))
    s_glo = torch.tensor([[[4.0, 3.0, 1.0, 0.0]]])
    zeros = torch.zeros(1, 1, 4)
    kv.state = {"s_glo": s_glo, "s_loc_past": s_glo.clone(), "s_loc_cur": zeros.clone(),
                "s_loc_cur_queries": zeros.clone(), "merged_mass": zeros.clone(), "merged_tokens": zeros.clone()}
    kv.tables = {"lut_position": torch.tensor([[[1, 2, -1]]]), "lut_centre": torch.tensor([[[7, 5, -1]]]),
                 "lut_norm": torch.tensor([[[2.0, 3.0, -1.0]]])}
    stats = AttentionStats(raw_keys=kv.keys)

    def members(out):
        t = out.tables
        return sorted((p, c, round(n, 4)) for p, c, n in zip(t["lut_position"][0, 0].tolist(),
                                                              t["lut_centre"][0, 0].tolist(),
                                                              t["lut_norm"][0, 0].tolist()) if p >= 0)

    # tau 1: R(7, 5) = cos((1, .1), (1, 0)) * 1 < 1: token 7 goes to the zero class, and its member 1 with it
    evicted = EMS(window=1, kernel_size=1, tau=1.0).compress(0, kv, stats, torch.tensor([3]), "decode")
    assert evicted.positions.tolist() == [[[5, 6, 8]]] and members(evicted) == [(2, 5, 3.0)]
    assert evicted.tables["lut_position"].shape[-1] == 9  # (gamma - 1) * N_budget = 3 * 3
    expansion = EMS(window=1, kernel_size=1).expand(0, evicted, rotate=None)
    assert expansion.kv.lengths.tolist() == [[4]] and expansion.kv.positions[0, 0, :4].tolist() == [5, 6, 8, 2]
    # the attention of the masked token is exactly the one over the three stored slots and member 2 alone
    query, query_pos = torch.tensor([[[[0.3, -0.2]]]]), torch.tensor([[9]])
    got, _ = attend(evicted, query, query_pos, expansion)
    member = 3.0 * evicted.keys[0, 0, 0]  # norm 3 along centre 5's unit key (1, 0)
    keys4 = torch.cat([evicted.keys[0, 0], member.view(1, 2)])
    values4 = torch.cat([evicted.values[0, 0], evicted.values[0, 0, :1]])
    torch.testing.assert_close(got[0, 0, 0], torch.softmax(keys4 @ query[0, 0, 0], 0) @ values4)
    # tau 0.6: token 7 merges into centre 5: its member follows, and token 7 itself joins at its own norm
    merged = EMS(window=1, kernel_size=1, tau=0.6).compress(0, kv, stats, torch.tensor([3]), "decode")
    assert members(merged) == [(1, 5, 2.0), (2, 5, 3.0), (7, 5, round(math.sqrt(1.01), 4))]


@pytest.mark.parametrize("positions", ["without", "with"])
def test_lut_expansion_batch_gqa_ragged(positions):
    # B = 2 ragged rows, 2 KV heads, 2 query heads per KV head. Stored centres are RoPE'd raw keys; members are
    # expanded to norm_j * RoPE_{p_j}(unit raw centre) ("with") or RoPE_{p_c} ("without"), with the centre's
    # value. The reference is built member by member from that definition and attended densely.
    g = torch.Generator().manual_seed(1)
    B, H, T, D, group = 2, 2, 4, 4, 2
    raw = torch.randn(B, H, T, D, generator=g)
    positions_ = torch.tensor([[10, 12, 15, 20], [3, 8, 9, -1]]).view(B, 1, T).expand(B, H, T).clone()
    lengths = torch.tensor([[4, 4], [3, 3]])
    kv = LayerKV(keys=rope(raw, positions_.clamp(min=0)), values=torch.randn(B, H, T, D, generator=g),
                 positions=positions_, lengths=lengths)
    kv.zero_padding()
    # members (position, centre position, norm) per row; -1 unused
    lut = [[[(11, 10, 2.0), (13, 12, 0.5), (14, 12, 1.5)], [(11, 15, 3.0), (-1, -1, -1.0), (-1, -1, -1.0)]],
           [[(1, 3, 1.0), (2, 8, 2.5), (-1, -1, -1.0)], [(4, 9, 0.7), (5, 3, 1.2), (6, 8, 2.0)]]]
    table = torch.tensor(lut)  # (B, H, E, 3)
    kv.tables = {"lut_position": table[..., 0].long(), "lut_centre": table[..., 1].long(),
                 "lut_norm": table[..., 2].float()}
    query = torch.randn(B, H * group, 1, D, generator=g)
    query_pos = torch.tensor([[30], [31]])
    expansion = EMS(positions=positions).expand(0, kv, rotate=rope)
    got, step = attend(kv, query, query_pos, expansion)
    for b in range(B):
        for h in range(H):
            n = int(lengths[b, h])
            keys, values, slots = list(kv.keys[b, h, :n]), list(kv.values[b, h, :n]), list(range(n))
            for p, c, norm in lut[b][h]:
                if p < 0:
                    continue
                s = positions_[b, h].tolist().index(c)
                unit = raw[b, h, s] / raw[b, h, s].norm()
                at = torch.tensor([p if positions == "with" else c])
                keys.append(norm * rope(unit.view(1, D), at)[0])
                values.append(kv.values[b, h, s])
                slots.append(s)
            K, V = torch.stack(keys), torch.stack(values)
            mass = torch.zeros(T)
            for hq in range(h * group, (h + 1) * group):
                p_attn = torch.softmax(K @ query[b, hq, 0], 0)
                torch.testing.assert_close(got[b, hq, 0], p_attn @ V, atol=1e-5, rtol=1e-5)
                mass.index_add_(0, torch.tensor(slots), p_attn / group)
            torch.testing.assert_close(step[b, h], mass, atol=1e-6, rtol=1e-5)


def test_zero_class_evicts_tbm_token_below_tau():
    kv, stats = one_row(KEYS, VALUES, SCORES)
    out = EMS(window=1, kernel_size=1, tau=0.7, gamma=2, expansion="bias").compress(
        0, kv, stats, torch.tensor([2]), "prefill")
    assert out.positions[0, 0].tolist() == [1, 4]
    assert torch.equal(out.keys[0, 0], torch.tensor([[2.0, 0.0], [1.0, 1.0]]))
    assert torch.equal(out.values[0, 0], torch.tensor([[1.0, 0.0], [7.0, 7.0]]))
    assert out.state["merged_mass"].abs().sum() == 0
    assert out.state["merged_tokens"].abs().sum() == 0 and out.state[LOGIT_BIAS].abs().sum() == 0


def test_gamma_one_is_eviction_only():
    kv, stats = one_row(KEYS, VALUES, SCORES)
    out = EMS(window=1, kernel_size=1, tau=0.0, gamma=1).compress(0, kv, stats, torch.tensor([2]), "prefill")
    assert torch.equal(out.keys[0, 0], torch.tensor([[2.0, 0.0], [1.0, 1.0]]))
    assert torch.equal(out.values[0, 0], torch.tensor([[1.0, 0.0], [7.0, 7.0]]))


def test_mean_pooling_picks_the_dense_region():
    # unpooled, slot 2 (0.9) wins; mean pooling over 3 gives slot 2 0.3 and slot 5 (0.5 + 0.5 + 0.5) / 3 = 0.5
    scores = [0.0, 0.0, 0.9, 0.0, 0.5, 0.5, 0.5, 0.0]
    keys = [[1.0, float(i)] for i in range(8)]
    kv, stats = one_row(keys, keys, scores)
    pooled = EMS(window=1, kernel_size=3, gamma=1).compress(0, kv, stats, torch.tensor([2]), "prefill")
    plain = EMS(window=1, kernel_size=1, gamma=1).compress(0, kv, stats, torch.tensor([2]), "prefill")
    assert pooled.positions[0, 0].tolist() == [5, 7]
    assert plain.positions[0, 0].tolist() == [2, 7]


def test_redundancy_variants_and_clamp():
    k_a, v_a = torch.tensor([[[[1.0, 0.0]]]]), torch.tensor([[[[0.0, 1.0]]]])
    k_b, v_b = torch.tensor([[[[1.0, 1.0], [-1.0, 0.0]]]]), torch.tensor([[[[0.0, 2.0], [0.0, -1.0]]]])
    c = 1 / math.sqrt(2)
    assert torch.allclose(redundancy(k_a, v_a, k_b, v_b, "key_value"), torch.tensor([[[[c, 0.0]]]]))
    assert torch.allclose(redundancy(k_a, v_a, k_b, v_b, "key"), torch.tensor([[[[c, 0.0]]]]))
    assert torch.allclose(redundancy(k_a, v_a, k_b, v_b, "value"), torch.tensor([[[[1.0, 0.0]]]]))


def test_rotate_like_recovers_rope():
    g = torch.Generator().manual_seed(0)
    raw, x = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    pos = torch.tensor([0, 1, 7, 100, 3000])
    assert torch.allclose(rotate_like(x, raw, rope(raw, pos)), rope(x, pos), atol=1e-5)


@pytest.mark.parametrize("positions", ["without", "with"])
def test_merged_key_is_rope_of_shared_direction(positions):
    raw = torch.tensor([[9.0, 9, 9, 9], [2, 1, 0, 0], [2, 1, 1, 1], [0, 0, 1, -1], [1, 1, 1, 1]])
    pos = torch.arange(5)
    post = rope(raw, pos)
    values = [v + [0.0, 0.0] for v in VALUES]  # same cosines as in 2-D
    kv, stats = one_row(post.tolist(), values, SCORES, raw_keys=raw.tolist())
    out = EMS(window=1, kernel_size=1, tau=0.6, gamma=2, positions=positions, expansion="bias").compress(
        0, kv, stats, torch.tensor([2]), "prefill")
    norms = raw.norm(dim=-1)
    shared = 0.75 * raw[1] / norms[1] + 0.25 * raw[2] / norms[2]
    shared = shared / shared.norm()
    if positions == "without":  # both members at the centre's position 1
        expected = (0.75 * norms[1] + 0.25 * norms[2]) * rope(shared.view(1, 4), torch.tensor([1]))[0]
    else:  # each member at its own position: the mean of the expanded keys
        expected = 0.75 * norms[1] * rope(shared.view(1, 4), torch.tensor([1]))[0] \
            + 0.25 * norms[2] * rope(shared.view(1, 4), torch.tensor([2]))[0]
    assert torch.allclose(out.keys[0, 0, 0], expected, atol=1e-5)
    assert torch.equal(out.keys[0, 0, 1], post[4])


def test_observe_rolls_local_window():
    kv = LayerKV.from_dense(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    scores = torch.tensor([[[1.0, 2.0, 3.0]]])
    method = EMS(window=2, kernel_size=1)
    stats = AttentionStats(column_sums=scores, window_column_sums=scores, raw_keys=kv.keys)
    kv = method.compress(0, kv, stats, torch.tensor([3]), "prefill")
    steps = [torch.tensor([[[0.5, 0.25, 0.25]]]), torch.tensor([[[0.1, 0.2, 0.7]]]),
             torch.tensor([[[0.0, 1.0, 0.0]]])]
    for step in steps:
        method.observe(0, kv, AttentionStats(step_attention=step))
    assert torch.allclose(kv.state["s_glo"], torch.tensor([[[1.6, 3.45, 3.95]]]))
    # after 2 queries past <- cur = step1 + step2; the third query starts a new cur
    assert torch.allclose(kv.state["s_loc_past"], torch.tensor([[[0.6, 0.45, 0.95]]]))
    assert torch.allclose(kv.state["s_loc_cur"], torch.tensor([[[0.0, 1.0, 0.0]]]))
    assert kv.state["s_loc_cur_queries"].tolist() == [[[1.0, 1.0, 1.0]]]


def test_decode_merges_lowest_centre_into_most_redundant():
    # After a decode append: centres 0, 1; slot 2 just left the window (window 1); slot 3 is the new token.
    keys = [[1.0, 0.0], [0.0, 1.0], [1.0, 0.1], [5.0, 5.0]]
    values = [[1.0, 0.0], [0.0, 1.0], [3.0, 0.0], [5.0, 5.0]]
    kv = LayerKV.from_dense(torch.tensor(keys).view(1, 1, 4, 2), torch.tensor(values).view(1, 1, 4, 2))
    zeros = torch.zeros(1, 1, 4)
    s_glo = torch.tensor([[[4.0, 3.0, 1.0, 0.0]]])
    kv.state = {"s_glo": s_glo, "s_loc_past": s_glo.clone(),
                "s_loc_cur": zeros.clone(), "s_loc_cur_queries": zeros.clone(),
                "merged_mass": torch.tensor([[[2.0, 0.0, 0.0, 0.0]]]),
                "merged_tokens": torch.tensor([[[2.0, 0.0, 1.0, 0.0]]]),  # slot 0 stands for 3 tokens, slot 2 for 2
                LOGIT_BIAS: torch.tensor([[[math.log(3.0), 0.0, math.log(2.0), 0.0]]])}
    stats = AttentionStats(raw_keys=kv.keys)
    out = EMS(window=1, kernel_size=1, tau=0.6, expansion="bias").compress(0, kv, stats, torch.tensor([3]), "decode")
    # s_Loc = s_Glo, so Global-Local = s_glo; slot 2 (score 1) is the TBM token, most redundant with slot 0
    assert out.positions[0, 0].tolist() == [0, 1, 3] and out.lengths.tolist() == [[3]]
    # weights: slot 0 = score 4 + mass 2 = 6, slot 2 = 1 -> 6/7, 1/7
    assert torch.allclose(out.values[0, 0, 0], torch.tensor([6 / 7 + 3 / 7, 0.0]))
    assert torch.allclose(out.state["merged_mass"][0, 0], torch.tensor([3.0, 0.0, 0.0]))
    # the two clusters' token counts add: 3 + 2 = 5 -> bias log 5; the new token stands for itself
    assert out.state["merged_tokens"].tolist() == [[[4.0, 0.0, 0.0]]]
    torch.testing.assert_close(out.state[LOGIT_BIAS], torch.tensor([[[math.log(5.0), 0.0, 0.0]]]))


def test_bad_config_names_value():
    with pytest.raises(ConfigError, match="similarity 'cos'"):
        EMS(similarity="cos")
    with pytest.raises(ConfigError, match="positions 'maybe'"):
        EMS(positions="maybe")
    with pytest.raises(ConfigError, match="gamma=0.5"):
        EMS(gamma=0.5)
    with pytest.raises(ConfigError, match="kernel_size=4"):
        EMS(kernel_size=4)
    with pytest.raises(ConfigError, match="tau=1.5"):
        EMS(tau=1.5)
    with pytest.raises(ConfigError, match="expansion 'mean'; accepted: lut, bias"):
        EMS(expansion="mean")
    with pytest.raises(ConfigError, match="multiplicity_bias=false"):
        EMS(multiplicity_bias=False)


# -- properties on random ragged caches ---------------------------------------------------------------

def random_case(seed: int, B: int, H: int, T: int, D: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B, H), generator=g)
    raw = torch.randn(B, H, T, D, generator=g)
    values = torch.randn(B, H, T, D, generator=g)
    positions = torch.arange(T).expand(B, H, T).clone()
    kv = LayerKV(keys=rope(raw, positions), values=values, positions=positions, lengths=lengths)
    kv.zero_padding()
    col = torch.rand(B, H, T, generator=g) * kv.valid()
    win = torch.rand(B, H, T, generator=g) * kv.valid()
    return kv, AttentionStats(column_sums=col, window_column_sums=win, raw_keys=raw * kv.valid().unsqueeze(-1)), g


def check_cache(out: LayerKV, kv: LayerKV, n_keep: torch.Tensor) -> None:
    expected = torch.minimum(n_keep.view(-1, 1), kv.lengths)
    assert torch.equal(out.lengths, expected)
    K = out.capacity
    assert out.keys.shape[2] == out.values.shape[2] == out.positions.shape[2] == K == int(expected.max())
    assert all(s.shape == out.positions.shape for s in out.state.values())
    real = out.valid()
    assert torch.isfinite(out.keys).all() and torch.isfinite(out.values).all()
    # every merge is convex: each value coordinate stays inside its row's input range
    lo = kv.values.masked_fill(~kv.valid().unsqueeze(-1), math.inf).amin(2, keepdim=True)
    hi = kv.values.masked_fill(~kv.valid().unsqueeze(-1), -math.inf).amax(2, keepdim=True)
    inside = (out.values >= lo - 1e-5) & (out.values <= hi + 1e-5)
    assert inside[real].all()
    # kept positions are distinct and increasing within each row
    diffs = out.positions[..., 1:] - out.positions[..., :-1]
    assert (diffs[real[..., 1:]] > 0).all()


def check_lut(out: LayerKV, seen: LayerKV) -> None:
    """Live LUT members: distinct tokens of the row, none of them stored, each pointing at a stored slot."""
    assert LOGIT_BIAS not in out.state
    position, centre = out.tables["lut_position"], out.tables["lut_centre"]
    live = position >= 0
    assert torch.equal(live, centre >= 0)
    stored = out.positions.masked_fill(~out.valid(), -2)
    for b, h in zip(*torch.nonzero(torch.ones(live.shape[:2])).T.tolist()):
        members = position[b, h][live[b, h]].tolist()
        row = set(stored[b, h].tolist()) - {-2}
        assert len(set(members)) == len(members) and not set(members) & row
        assert set(centre[b, h][live[b, h]].tolist()) <= row
        assert max(members, default=-1) <= int(seen.positions[b, h].max())


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), B=st.integers(1, 2), H=st.integers(1, 3), T=st.integers(1, 40),
       budget=st.integers(1, 20), window=st.integers(1, 6), gamma=st.sampled_from([1, 2, 4, math.inf]),
       tau=st.sampled_from([0.0, 0.3, 0.6, 1.0]), similarity=st.sampled_from(["key_value", "key", "value"]),
       positions=st.sampled_from(["with", "without"]), expansion=st.sampled_from(["lut", "bias"]))
def test_prefill_then_decode_properties(seed, B, H, T, budget, window, gamma, tau, similarity, positions, expansion):
    kv, stats, g = random_case(seed, B, H, T, 4)
    method = EMS(window=window, kernel_size=3, tau=tau, gamma=gamma, similarity=similarity, positions=positions,
                 expansion=expansion)
    n_keep = torch.full((B,), budget)
    out = method.compress(0, kv, stats, n_keep, "prefill")
    again = method.compress(0, kv, stats, n_keep, "prefill")
    check_cache(out, kv, n_keep)
    assert torch.equal(out.keys, again.keys) and torch.equal(out.values, again.values)
    if positions == "without":  # a merged key's norm is a weighted mean of its members' norms
        row_min = kv.keys.norm(dim=-1).masked_fill(~kv.valid(), math.inf).amin(-1, keepdim=True)  # (B, H, 1)
        assert (out.keys.norm(dim=-1) >= row_min - 1e-4)[out.valid()].all()
    for step in range(3):  # decode: append one token, observe its attention, compress back to n_keep
        before = out.lengths.clone()
        pos = out.positions.amax(-1).amax(-1) + 1  # (B,)
        raw_new = torch.randn(B, H, 1, 4, generator=g)
        out.append(rope(raw_new, pos.view(B, 1, 1).expand(B, H, 1)), torch.randn(B, H, 1, 4, generator=g),
                   pos.view(B, 1))
        attn = torch.rand(B, H, out.capacity, generator=g) * out.valid()  # aligned with storage, as the engine
        method.observe(0, out, AttentionStats(step_attention=attn / attn.sum(-1, keepdim=True).clamp(min=1e-9)))
        raw = rope(out.keys, -out.positions)  # undo the rotation, as the engine does
        full = out
        out = method.compress(0, out, AttentionStats(step_attention=attn, raw_keys=raw), n_keep, "decode")
        assert torch.equal(out.lengths, torch.minimum(n_keep.view(-1, 1), before + 1))
        assert torch.isfinite(out.keys).all() and torch.isfinite(out.values).all()
        assert all(torch.isfinite(s).all() for s in out.state.values())
        # every entry stands for at least its own token, at most every token the row has seen; bias = log count
        count = (out.state["merged_tokens"] + 1) * out.valid()
        assert bool((count.sum(-1) <= kv.lengths + step + 1).all())  # prompt + appended tokens
        if expansion == "bias":
            torch.testing.assert_close(out.state[LOGIT_BIAS], count.clamp(min=1).log())
        else:  # every LUT member is a token no stored slot holds, expanded from a stored slot of its row
            check_lut(out, full)
        # the newest token is in the local window: always kept, unchanged
        newest = out.positions.amax(-1) == full.positions.amax(-1)
        assert newest.all()


# -- end to end on the tiny model --------------------------------------------------------------------

@pytest.mark.parametrize("positions", ["without", "with"])
def test_engine_keeps_rows_at_budget_while_decoding(tiny_model, positions):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, tiny_model.config.vocab_size, (n,), generator=g).tolist() for n in (90, 57)]
    engine = Engine(tiny_model, EMS(window=8, positions=positions), Budget("tokens", 24))
    session = engine.prefill(prompts, max_new_tokens=12)
    assert (session.cache.lengths() == 24).all()
    for _ in range(12):
        logits = session.feed(session.logits.argmax(-1).view(-1, 1))
        assert torch.isfinite(logits).all()
        assert (session.cache.lengths() == 24).all()
    kv = session.cache.kv(0)
    assert (kv.positions.amax(-1) == torch.tensor([90 + 11, 57 + 11]).view(2, 1)).all()
    # the LUT is stored: (gamma - 1) * 24 = 72 members a head, 20 bytes each (two int64 positions, a float32 norm)
    assert kv.tables["lut_position"].shape[-1] == 72 and kv.table_bytes == 72 * 20
    heads = kv.lengths.shape[1]
    expected = sum(24 * heads * layer.kv.slot_bytes + heads * layer.kv.table_bytes for layer in session.cache.layers)
    assert session.cache.row_bytes().tolist() == [expected, expected]


def test_engine_lut_with_cache_length_positions_and_prompt_chunks(tiny_model):
    # RoPE at the cache length (members rotated by their offset from the centre) and a chunked prompt (the
    # later chunks attend the expanded cache): finite, at budget, the same as the bias variant when nothing merges
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, tiny_model.config.vocab_size, (n,), generator=g).tolist() for n in (70, 41)]
    for kwargs in ({"position_mode": "cache_length"}, {"prefill_chunk_size": 16}):
        engine = Engine(tiny_model, EMS(window=4, positions="with"), Budget("tokens", 16), **kwargs)
        gens = engine.generate(prompts, max_new_tokens=6, stop_token_ids=set())
        assert all(len(gen.tokens) == 6 and gen.kept_per_layer_head == [[16] * 2] * 2 for gen in gens)
    lut = Engine(tiny_model, EMS(window=4, gamma=1), Budget("tokens", 16), prefill_chunk_size=16)
    bias = Engine(tiny_model, EMS(window=4, gamma=1, expansion="bias"), Budget("tokens", 16), prefill_chunk_size=16)
    assert [g.tokens for g in lut.generate(prompts, 6, set())] == [g.tokens for g in bias.generate(prompts, 6, set())]
