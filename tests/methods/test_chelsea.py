"""Chelsea: Chunked Soft Matching edges, degree-weighted centroids, budget, outlier heads, calibration.

Expected values are worked out by hand in the comments.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.errors import ConfigError
from kvbench.kernels.attention_stats import ragged_attention
from kvbench.kernels.matching import chunked_soft_matching
from kvbench.kernels.select import topk_mask
from kvbench.kv import LOGIT_BIAS, AttentionStats, LayerKV
from kvbench.methods.chelsea import MERGED, Chelsea
from kvbench.methods.chelsea_calibrate import CONF, calibrate, edgeless_fraction

# Slot keys (2-D): A slots are 0, 2 (even offsets), B slots 1, 3.
# cos(k0, k1) = 0, cos(k0, k3) = 0.8 -> A0's edge goes to B3 (0.8); cos(k2, k1) = 0.6, cos(k2, k3) = 0.28 -> B1
FOUR = [[1.0, 0.0], [0.0, 1.0], [0.8, 0.6], [0.8, -0.6]]


def cache(keys, values=None) -> LayerKV:
    k = torch.tensor(keys, dtype=torch.float32).view(1, 1, len(keys), -1)
    v = k.clone() if values is None else torch.tensor(values, dtype=torch.float32).view(1, 1, len(values), -1)
    return LayerKV.from_dense(k, v)


def one(x: int) -> torch.Tensor:
    return torch.tensor([[x]])


def test_csm_edges_of_a_chunk_with_a_known_most_similar_pair():
    kv = cache(FOUR)
    partner, sim = chunked_soft_matching(kv.keys, one(0), one(4), chunk_size=256)
    assert partner.tolist() == [[[3, -1, 1, -1]]]
    torch.testing.assert_close(sim[0, 0, [0, 2]], torch.tensor([0.8, 0.6]))
    assert sim[0, 0, 1] == -float("inf") and sim[0, 0, 3] == -float("inf")


def test_csm_edges_stay_inside_their_chunk_and_region():
    # chunk_size 2: chunks {0,1} and {2,3}: A0 can only reach B1 (cos 0), A2 only B3 (cos 0.28).
    partner, sim = chunked_soft_matching(cache(FOUR).keys, one(0), one(4), chunk_size=2)
    assert partner.tolist() == [[[1, -1, 3, -1]]]
    torch.testing.assert_close(sim[0, 0, [0, 2]], torch.tensor([0.0, 0.28]))
    # region [1, 4): A = slots 1, 3; B = slot 2. cos(k1, k2) = 0.6, cos(k3, k2) = 0.28
    partner, sim = chunked_soft_matching(cache(FOUR).keys, one(1), one(3), chunk_size=None)
    assert partner.tolist() == [[[-1, 2, -1, 2]]]
    torch.testing.assert_close(sim[0, 0, [1, 3]], torch.tensor([0.6, 0.28]))


def test_topk_mask_ties_go_to_the_earlier_slot():
    scores = torch.tensor([[[0.5, -float("inf"), 0.5, 0.9]]])
    assert topk_mask(scores, one(2)).tolist() == [[[True, False, False, True]]]
    assert topk_mask(scores, one(5)).tolist() == [[[True, False, True, True]]]


def test_one_step_merges_the_best_edge_into_a_degree_weighted_centroid():
    # target 3 of 4 slots: one edge, the best one (A0 -> B3, cos 0.8). Slot 0 already holds 3 tokens
    # (merged_tokens 2), slot 3 one: k = (3 k0 + 1 k3) / 4 = (0.95, -0.15); degree 4 -> merged_tokens 3.
    kv = cache(FOUR, [[4.0, 0.0], [1.0, 1.0], [2.0, 2.0], [0.0, 8.0]])
    kv.state[MERGED] = torch.tensor([[[2.0, 0.0, 0.0, 0.0]]])
    out = Chelsea(sinks=0, recent=0, chunk_size=None).compress(0, kv, AttentionStats(), torch.tensor([3]), "prefill")
    assert out.positions.tolist() == [[[1, 2, 3]]]  # the centroid sits at the B slot (position 3)
    torch.testing.assert_close(out.keys[0, 0, 2], torch.tensor([0.95, -0.15]))
    torch.testing.assert_close(out.values[0, 0, 2], torch.tensor([3.0, 2.0]))  # (3 (4,0) + (0,8)) / 4
    assert out.state[MERGED].tolist() == [[[0.0, 0.0, 3.0]]]
    torch.testing.assert_close(out.keys[0, 0, :2], kv.keys[0, 0, 1:3])
    # degree bias: log(degree) = log 4 on the centroid, log 1 = 0 on the untouched slots
    torch.testing.assert_close(out.state[LOGIT_BIAS], torch.tensor([[[0.0, 0.0, math.log(4.0)]]]))
    kv.state = {MERGED: torch.tensor([[[2.0, 0.0, 0.0, 0.0]]])}
    plain = Chelsea(sinks=0, recent=0, chunk_size=None, degree_bias=False).compress(
        0, kv, AttentionStats(), torch.tensor([3]), "prefill")
    assert LOGIT_BIAS not in plain.state and torch.equal(plain.keys, out.keys)


def test_degree_bias_makes_a_centroid_attend_like_its_identical_members():
    # Slots 0-3 share key k; A slots 0, 2 both match B slot 1 with cosine 1 (ties -> the earlier B slot), A4's
    # best cosine is below 1. Target 4 = 2 edges: slots 0, 2 join 1 -> a centroid of degree 3 (bias log 3).
    g = torch.Generator().manual_seed(1)
    k = torch.randn(4, generator=g)
    keys = torch.stack([k, k, k, k, torch.randn(4, generator=g), torch.randn(4, generator=g)]).view(1, 1, 6, 4)
    values = torch.randn(1, 1, 6, 4, generator=g)  # the members' values differ: the centroid takes their mean
    kv = LayerKV.from_dense(keys, values)
    out = Chelsea(sinks=0, recent=0, chunk_size=None).compress(0, kv, AttentionStats(), torch.tensor([4]), "prefill")
    assert out.positions.tolist() == [[[1, 3, 4, 5]]]
    torch.testing.assert_close(out.state[LOGIT_BIAS], torch.tensor([[[math.log(3.0), 0.0, 0.0, 0.0]]]))
    query, query_pos = torch.randn(1, 2, 1, 4, generator=g), torch.tensor([[9]])
    dense, _ = ragged_attention(query, keys, values, kv.valid(), kv.positions, query_pos, 0.5)
    merged, _ = ragged_attention(query, out.keys, out.values, out.valid(), out.positions, query_pos, 0.5,
                                 key_bias=out.state[LOGIT_BIAS])
    torch.testing.assert_close(merged, dense)
    unbiased, _ = ragged_attention(query, out.keys, out.values, out.valid(), out.positions, query_pos, 0.5)
    assert not torch.allclose(unbiased, dense)  # without the bias the centroid counts once


def test_ratio_schedule():
    method = Chelsea(r0=0.5, r_decay=0.1, r_steps=3, r_min=0.25)
    assert [round(method.ratio(t), 6) for t in range(6)] == [0.5, 0.4, 0.3, 0.25, 0.25, 0.25]
    assert [Chelsea().ratio(t) for t in range(3)] == [0.5, 0.5, 0.5]


def test_one_step_removes_at_most_r_of_the_region():
    # 16 slots, sinks 2, recent 2: region 12; r = 0.25 -> floor(3) edges in step 0, whatever the excess.
    kv = LayerKV.from_dense(torch.randn(1, 1, 16, 4, generator=torch.Generator().manual_seed(0)),
                            torch.zeros(1, 1, 16, 4))
    kv.state[MERGED] = torch.zeros(1, 1, 16)
    method = Chelsea(sinks=2, recent=2, chunk_size=4, r0=0.25)
    out = method.cluster_step(kv, one(5), method.ratio(0))
    assert out.lengths.tolist() == [[13]]
    assert out.positions[0, 0, :2].tolist() == [0, 1] and out.positions[0, 0, -2:].tolist() == [14, 15]


def outlier_file(tmp_path, heads, layers=2, kv_heads=2):
    path = tmp_path / "heads.json"
    path.write_text(json.dumps({"num_layers": layers, "num_key_value_heads": kv_heads, "outlier_heads": heads}))
    return str(path)


def test_outlier_heads_keep_full_cache_and_budget_is_reallocated(tmp_path):
    method = Chelsea(sinks=4, recent=8, outlier_heads_file=outlier_file(tmp_path, [[0, 1]]))
    # H = 2 layers x 2 heads = 4, H_o = 1, B = 50, prompt 100 + 20 new tokens: an outlier head ends with
    # T = 120 slots, so B' = floor((4*50 - 1*120) / 3) = floor(26.67) = 26
    prompt = [AttentionStats(num_queries=torch.tensor([100]))] * 2
    budgets = method.layer_budgets(torch.tensor([50]), 2, prompt, 20)
    assert budgets.tolist() == [[26], [26]]
    # nothing to generate: T = 100, B' = floor(100 / 3) = 33
    assert method.layer_budgets(torch.tensor([50]), 2, prompt, 0).tolist() == [[33], [33]]
    kv = LayerKV.from_dense(torch.randn(1, 2, 100, 4), torch.randn(1, 2, 100, 4))
    out = method.compress(0, kv, AttentionStats(), budgets[0], "prefill")
    assert out.lengths.tolist() == [[26, 100]]
    assert torch.equal(out.keys[0, 1], kv.keys[0, 1])
    assert out.state[LOGIT_BIAS][0, 1].abs().sum() == 0  # the full head is never merged
    assert method.compress(1, kv, AttentionStats(), budgets[1], "prefill").lengths.tolist() == [[26, 26]]


def test_outlier_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="missing.json"):
        Chelsea(outlier_heads_file=str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match=r"\(5, 0\)"):
        Chelsea(outlier_heads_file=outlier_file(tmp_path, [[5, 0]]))
    method = Chelsea(outlier_heads_file=outlier_file(tmp_path, [[0, 0]], kv_heads=8))
    with pytest.raises(ConfigError, match="8 KV heads"):
        method.compress(0, LayerKV.from_dense(torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4)), AttentionStats(),
                        torch.tensor([4]), "prefill")


@pytest.mark.parametrize("bad", [dict(r0=0.6), dict(r0=0.0), dict(chunk_size=1), dict(sinks=-1),
                                 dict(r_min=0.7), dict(decode_interval=0)])
def test_bad_config_names_the_value(bad):
    with pytest.raises(ConfigError, match=str(list(bad.values())[0])):
        Chelsea(**bad)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 48), st.integers(1, 40), st.sampled_from([0, 2, 16]),
       st.sampled_from([0, 3, 64]), st.sampled_from([2, 5, 256, None]), st.sampled_from([0.1, 0.5]),
       st.integers(0, 2**16))
def test_chelsea_properties(B, H, T, budget, sinks, recent, chunk, r0, seed):
    gen = torch.Generator().manual_seed(seed)
    kv = LayerKV.from_dense(torch.randn(B, H, T, 4, generator=gen), torch.randn(B, H, T, 4, generator=gen))
    kv.lengths = torch.randint(1, T + 1, (B, 1), generator=gen).expand(B, H).clone()
    kv.zero_padding()
    n_keep = torch.randint(1, budget + 1, (B,), generator=gen)
    method = Chelsea(sinks=sinks, recent=recent, chunk_size=chunk, r0=r0)
    out = method.compress(0, kv, AttentionStats(), n_keep, "prefill")
    again = method.compress(0, kv, AttentionStats(), n_keep, "prefill")
    expected = torch.minimum(kv.lengths, n_keep.view(-1, 1))
    assert torch.equal(out.lengths, expected)  # exactly the budget (or everything, if shorter)
    degree = out.state[MERGED] + out.valid()
    assert torch.equal(degree.sum(-1), kv.lengths.float())  # every original token is in exactly one slot
    assert out.keys.shape[:3] == out.values.shape[:3] == out.positions.shape
    assert bool(torch.isfinite(out.keys).all() and torch.isfinite(out.values).all())
    assert torch.equal(out.keys, again.keys) and torch.equal(out.values, again.values)
    for b in range(B):
        for h in range(H):
            n, k = int(kv.lengths[b, h]), int(out.lengths[b, h])
            pos = out.positions[b, h, :k]
            assert bool((pos[1:] > pos[:-1]).all()) and 0 <= int(pos[0]) and int(pos[-1]) < n
            keep_recent = min(recent, k - 1)
            keep_sinks = min(sinks, k - 1 - keep_recent)
            if k < n:  # protected windows untouched
                assert pos[:keep_sinks].tolist() == list(range(keep_sinks))
                assert pos[k - keep_recent:].tolist() == list(range(n - keep_recent, n))
                assert torch.equal(out.keys[b, h, k - keep_recent:k], kv.keys[b, h, n - keep_recent:n])


def test_decode_reclusters_every_interval_within_budget(tiny_model):
    # prompt 200 + 40 new tokens, budget 0.2 -> B = round(0.2 * 240) = 48 per head. Interval 8: the cache grows
    # to B + 7 and is brought back to B at every 8th step.
    method = Chelsea(sinks=4, recent=8, chunk_size=16, decode_interval=8)
    engine = Engine(tiny_model, method, Budget("fraction", 0.2))
    prompt = torch.randint(3, 200, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    session = engine.prefill([prompt], max_new_tokens=40)
    assert session.cache.lengths().unique().tolist() == [48]
    for step in range(1, 17):
        session.feed(torch.tensor([[5]]))
        lengths = session.cache.lengths().unique().tolist()
        assert lengths == ([48] if step % 8 == 0 else [48 + step % 8])
        for kv in session.cache.layers:  # the bias follows the degree through re-clustering; new slots get 0
            kv = kv.kv
            torch.testing.assert_close(kv.state[LOGIT_BIAS], torch.log1p(kv.state[MERGED]) * kv.valid())
            assert kv.state[LOGIT_BIAS][:, :, 48:48 + step % 8].abs().sum() == 0
    kv = session.cache.kv(0)
    assert float((kv.state[MERGED] + kv.valid()).sum()) == 2 * 216  # 2 heads x 216 tokens seen


def test_edgeless_fraction_and_calibration(tmp_path):
    # region = all 4 slots, one chunk; A0 -> 0.8, A2 -> 0.6. Threshold 0.7: A2 has no edge -> 1/2.
    frac = edgeless_fraction(cache(FOUR).keys, 0.7, chunk_size=256, sinks=0, recent=0)
    assert frac.tolist() == [[0.5]]
    text = tmp_path / "wiki.txt"
    text.write_text(" = Valkyrie = \n The ship was launched in 1901 and sank in 1915 . \n" * 40)
    from omegaconf import OmegaConf

    from kvbench.methods.chelsea_calibrate import DEFAULTS

    cfg = OmegaConf.create({**DEFAULTS, "model": "tiny-llama-random", "text": str(text), "sequence_length": 256,
                            "num_sequences": 2, "outlier_ratio": 0.25, "chunk_size": 64})
    result = calibrate(cfg)
    assert (result["num_layers"], result["num_key_value_heads"], result["num_sequences"]) == (2, 2, 2)
    assert len(result["outlier_heads"]) == 1  # round(0.25 * 4)
    layer, head = result["outlier_heads"][0]
    assert result["scores"][layer][head] == max(max(row) for row in result["scores"])
    path = tmp_path / "heads.json"
    path.write_text(json.dumps(result))
    assert Chelsea(outlier_heads_file=str(path))._outliers["heads"] == [(layer, head)]


def test_experiment_calibrates_outlier_heads_before_a_chelsea_job(tmp_path):
    # chelsea_longbench: chelsea reads the top-level chelsea_outlier_heads; the Hydra callback writes that file
    # from the job's own model before the run (and leaves other methods and an existing file alone).
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from kvbench.methods.chelsea_calibrate import CalibrateOutlierHeads

    text = tmp_path / "wiki.txt"
    text.write_text(" = Valkyrie = \n The ship was launched in 1901 and sank in 1915 . \n" * 40)
    overrides = ["+experiment=chelsea_longbench", "model=tiny-llama-random", f"results_root={tmp_path}",
                 f"hydra.callbacks.chelsea_calibration.text={text}"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        job = compose(config_name="config", overrides=[*overrides, "method=chelsea"], return_hydra_config=True)
        other = compose(config_name="config", overrides=[*overrides, "method=full"], return_hydra_config=True)
    out = tmp_path / "chelsea_outlier_heads" / "tiny-llama-random.json"
    assert job.method.outlier_heads_file == str(out)
    settings = {k: v for k, v in job.hydra.callbacks.chelsea_calibration.items() if k != "_target_"}
    callback = CalibrateOutlierHeads(**settings, sequence_length=128, num_sequences=1)
    callback.on_job_start(other, task_function=None)
    assert not out.exists()
    callback.on_job_start(job, task_function=None)
    result = json.loads(out.read_text())
    assert (result["num_layers"], result["num_key_value_heads"], result["outlier_ratio"]) == (2, 2, 0.04)
    assert (result["sinks"], result["recent"], result["chunk_size"]) == (16, 64, 256)  # the job's method values
    assert instantiate(job.method)._outliers["heads"] == [tuple(h) for h in result["outlier_heads"]]
    out.write_text(out.read_text().replace('"outlier_ratio": 0.04', '"outlier_ratio": 0.5'))
    callback.on_job_start(job, task_function=None)  # an existing file is reused, not recalibrated
    assert json.loads(out.read_text())["outlier_ratio"] == 0.5
    with pytest.raises(ConfigError, match="out"):
        CalibrateOutlierHeads(out="x.json")


def test_ratio_one_half_merges_every_a_slot_on_every_step_but_the_last():
    # r0 = 0.5 (default): floor(0.5 x 8) = 4 edges = one per A slot (offsets 0, 2, 4, 6), so the first step
    # merges all of them whatever their similarity (keys here: alternating orthogonal directions, cosine 0 or
    # -1); the last step stops at the budget (excess 2 of 4 edges).
    keys = [[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]] * 2
    method = Chelsea(sinks=0, recent=0, chunk_size=None)
    kv = cache(keys)
    kv.state[MERGED] = torch.zeros(1, 1, 8)  # as compress starts it: every slot one token
    first = method.cluster_step(kv, torch.tensor([[2]]), method.ratio(0))
    assert first.positions[0, 0].tolist() == [1, 3, 5, 7]  # only B slots survive
    last = method.cluster_step(first, torch.tensor([[2]]), method.ratio(1))
    assert last.lengths.tolist() == [[2]]
