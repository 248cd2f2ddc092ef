"""Eviction baselines: StreamingLLM, H2O, SnapKV, PyramidKV, TOVA.

Unit tests use hand-built caches and statistics; every expected list of kept positions is worked out by hand
in the comment next to it. End-to-end tests run the tiny random model through the engine.
"""

from __future__ import annotations

import pytest
import torch

from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.errors import ConfigError
from kvbench.kv import AttentionStats, LayerKV
from kvbench.methods.h2o import H2O
from kvbench.methods.pyramidkv import PyramidKV
from kvbench.methods.snapkv import SnapKV
from kvbench.methods.streamingllm import StreamingLLM
from kvbench.methods.tova import TOVA


def make_kv(lengths: list[list[int]], capacity: int) -> LayerKV:
    """Cache (B, H, capacity) whose slot s of every row holds position s; rows hold ``lengths[b][h]`` slots."""
    B, H = len(lengths), len(lengths[0])
    keys = torch.randn(B, H, capacity, 4, generator=torch.Generator().manual_seed(0))
    kv = LayerKV.from_dense(keys, keys + 1)
    kv.lengths = torch.tensor(lengths)
    kv.zero_padding()
    return kv


def kept(kv: LayerKV) -> list[list[list[int]]]:
    """Positions held by every row, [b][h] -> list."""
    B, H = kv.lengths.shape
    return [[kv.positions[b, h, : kv.lengths[b, h]].tolist() for h in range(H)] for b in range(B)]


def rows(*values: list[float], capacity: int | None = None) -> torch.Tensor:
    """Statistics rows (one per head) zero-padded to ``capacity`` -> (1, H, capacity)."""
    capacity = capacity or max(len(v) for v in values)
    out = torch.zeros(1, len(values), capacity)
    for h, v in enumerate(values):
        out[0, h, : len(v)] = torch.tensor(v)
    return out


# -- StreamingLLM ------------------------------------------------------------------------------------------


def test_streamingllm_keeps_sinks_and_recent_window():
    kv = make_kv([[10, 10]], 10)
    out = StreamingLLM().compress(0, kv, AttentionStats(), torch.tensor([6]), "prefill")
    assert kept(out) == [[[0, 1, 2, 3, 8, 9]] * 2]  # 4 sinks + 2 recent
    out = StreamingLLM(sinks=2).compress(0, kv, AttentionStats(), torch.tensor([6]), "prefill")
    assert kept(out) == [[[0, 1, 6, 7, 8, 9]] * 2]  # 2 sinks + 4 recent
    out = StreamingLLM().compress(0, kv, AttentionStats(), torch.tensor([3]), "prefill")
    assert kept(out) == [[[0, 1, 2]] * 2]  # budget below the sinks: the first n_keep tokens


def test_streamingllm_ragged_rows():
    # sample 0: 10 slots, budget 6; sample 1: head 0 has 7 slots (budget 5), head 1 has 4 (<= budget: all)
    kv = make_kv([[10, 10], [7, 4]], 10)
    out = StreamingLLM().compress(0, kv, AttentionStats(), torch.tensor([6, 5]), "prefill")
    assert kept(out) == [[[0, 1, 2, 3, 8, 9]] * 2, [[0, 1, 2, 3, 6], [0, 1, 2, 3]]]
    assert out.lengths.tolist() == [[6, 6], [5, 4]]


# -- H2O ---------------------------------------------------------------------------------------------------

H2O_PREFILL = rows(
    [5.0, 0.1, 3.0, 0.2, 4.0, 0.3, 0.0, 9.0, 9.0, 9.0],  # heavy: 0 (5.0), 4 (4.0), 2 (3.0)
    [0.1, 6.0, 0.2, 0.3, 0.4, 7.0, 5.0, 0.0, 0.0, 0.0],  # heavy: 5 (7.0), 1 (6.0), 6 (5.0)
)


def test_h2o_prefill_keeps_heavy_hitters_and_recent_window():
    out = H2O().compress(0, make_kv([[10, 10]], 10), AttentionStats(column_sums=H2O_PREFILL), torch.tensor([6]),
                         "prefill")
    # budget 6 = 3 heavy (top column sums among 0..6) + 3 recent (7, 8, 9)
    assert kept(out) == [[[0, 2, 4, 7, 8, 9], [1, 5, 6, 7, 8, 9]]]
    assert out.state["score"][0, 0, :3].tolist() == [5.0, 3.0, 4.0]  # the score moved with its slot


def test_h2o_sinks_come_out_of_the_heavy_share():
    out = H2O(sinks=1).compress(0, make_kv([[10, 10]], 10), AttentionStats(column_sums=H2O_PREFILL),
                                torch.tensor([6]), "prefill")
    # head 0: sink 0 (already the top score), then 4 and 2; head 1: sink 0, then 5 and 1; recent 7, 8, 9
    assert kept(out) == [[[0, 2, 4, 7, 8, 9], [0, 1, 5, 7, 8, 9]]]


def test_h2o_heavy_ratio_rounds_down_to_the_recent_window():
    out = H2O(heavy_ratio=0.75).compress(0, make_kv([[10, 10]], 10), AttentionStats(column_sums=H2O_PREFILL),
                                         torch.tensor([6]), "prefill")
    # heavy = floor(4.5) = 4 among 0..7, recent = 2 (8, 9); head 0: 7 (9.0), 0, 4, 2; head 1: 5, 1, 6, 4 (0.4)
    assert kept(out) == [[[0, 2, 4, 7, 8, 9], [1, 4, 5, 6, 8, 9]]]


def test_h2o_decode_accumulates_attention_over_steps():
    method = H2O()
    kv = make_kv([[6, 6]], 6)
    prefill = rows([3.0, 0.1, 1.5, 0.5, 0.4, 0.3], [0.1, 3.0, 0.2, 1.0, 0.4, 0.3])
    kv = method.compress(0, kv, AttentionStats(column_sums=prefill), torch.tensor([4]), "prefill")
    # budget 4 = 2 heavy + 2 recent: head 0 keeps 0 (3.0), 2 (1.5); head 1 keeps 1 (3.0), 3 (1.0); recent 4, 5
    assert kept(kv) == [[[0, 2, 4, 5], [1, 3, 4, 5]]]
    kv.reserve(3)  # as the engine does before decoding: the storage has more slots than the rows use
    steps = [  # attention of the new query to the 5 slots (4 kept + itself); head 1 always uniform
        [0.2, 0.0, 0.1, 0.5, 0.2],  # head 0 scores -> [3.2, 1.5, 0.5, 0.8, 0.2]; recent 5, 6; keep 0, 2
        [0.1, 0.0, 0.8, 0.05, 0.05],  # [3.3, 1.5, 1.6, .25, .05]: pos 5 (0.3 + 0.5 + 0.8) beats pos 2 (1.5)
        [0.1, 0.1, 0.1, 0.6, 0.1],  # [3.4, 1.7, .35, .65, .1]; recent 7, 8; heavy 0 (3.4), 5 (1.7)
    ]
    expected = [
        [[0, 2, 5, 6], [1, 3, 5, 6]],
        [[0, 5, 6, 7], [1, 3, 6, 7]],
        [[0, 5, 7, 8], [1, 3, 7, 8]],
    ]
    for step, (attention, want) in enumerate(zip(steps, expected)):
        kv.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), torch.tensor([[6 + step]]))
        stats = AttentionStats(step_attention=rows(attention, [0.2] * 5, capacity=kv.capacity))
        method.observe(0, kv, stats)
        kv = method.compress(0, kv, stats, torch.tensor([4]), "decode")
        assert kept(kv) == [want]
    torch.testing.assert_close(kv.state["score"][0, :, :4], torch.tensor([[3.4, 1.7, 0.65, 0.1],
                                                                           [3.6, 1.6, 0.4, 0.2]]))


def test_h2o_mean_over_observers_divides_by_the_queries_that_saw_each_token():
    # 6 prompt slots seen by 6, 5, 4, 3, 2, 1 queries; sums 2.7, 2.0, 1.0, 1.5, 0.7, 0.7
    # -> means 0.45, 0.4, 0.25, 0.5, 0.35, 0.7. heavy_ratio=1 (no recent window), budget 3:
    # sum keeps 0, 1, 3; mean_over_observers keeps 5 (0.7), 3 (0.5), 0 (0.45).
    column_sums = rows([2.7, 2.0, 1.0, 1.5, 0.7, 0.7])
    by_sum = H2O(heavy_ratio=1.0).compress(0, make_kv([[6]], 6), AttentionStats(column_sums=column_sums),
                                           torch.tensor([3]), "prefill")
    assert kept(by_sum) == [[[0, 1, 3]]]
    by_mean = H2O(heavy_ratio=1.0, normalize="mean_over_observers").compress(
        0, make_kv([[6]], 6), AttentionStats(column_sums=column_sums), torch.tensor([3]), "prefill")
    assert kept(by_mean) == [[[0, 3, 5]]]


def test_h2o_mean_over_observers_counts_every_query_of_a_pass():
    method = H2O(normalize="mean_over_observers")
    kv = method.compress(0, make_kv([[6]], 6), AttentionStats(column_sums=rows([2.7, 2.0, 1.0, 1.5, 0.7, 0.7])),
                         torch.tensor([4]), "prefill")
    # 2 heavy among 0..3 by mean (0.45, 0.4, 0.25, 0.5): 3 and 0; recent 4, 5. Observers 6, 3, 2, 1.
    assert kept(kv) == [[[0, 3, 4, 5]]]
    assert kv.state["observations"][0, 0].tolist() == [6.0, 3.0, 2.0, 1.0]
    kv.reserve(2)
    kv.append(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), torch.tensor([[6, 7]]))
    step = rows([0.0, 0.1, 0.2, 0.3, 0.9, 0.5], capacity=kv.capacity)  # summed over the pass's 2 queries
    method.observe(0, kv, AttentionStats(step_attention=step, num_queries=torch.tensor([2])))
    # observers +2 on the old slots, +2 and +1 on the new ones: 8, 5, 4, 3, 2, 1; scores 2.7, 1.6, 0.9, 1.0
    # -> means of positions 0, 3, 4, 5: 0.3375, 0.32, 0.225, 0.333; heavy 0 and 5, recent 6, 7.
    assert kv.state["observations"][0, 0, :6].tolist() == [8.0, 5.0, 4.0, 3.0, 2.0, 1.0]
    out = method.compress(0, kv, AttentionStats(), torch.tensor([4]), "decode")
    assert kept(out) == [[[0, 5, 6, 7]]]


def test_h2o_ragged_rows():
    column_sums = torch.stack([H2O_PREFILL[0], rows([0.1, 2.0, 0.3, 1.0, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0],
                                                    [1.0, 0.5, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])[0]])
    kv = make_kv([[10, 10], [7, 4]], 10)
    out = H2O().compress(0, kv, AttentionStats(column_sums=column_sums), torch.tensor([6, 4]), "prefill")
    # sample 1 head 0: 7 slots, budget 4 = 2 heavy among 0..4 (1: 2.0, 3: 1.0) + recent 5, 6;
    # head 1: 4 slots <= budget, all kept
    assert kept(out) == [[[0, 2, 4, 7, 8, 9], [1, 5, 6, 7, 8, 9]], [[1, 3, 5, 6], [0, 1, 2, 3]]]


# -- SnapKV ------------------------------------------------------------------------------------------------

# Observation-window votes; slots 8, 9 are the window (their own large votes must not leak into pooling).
SNAP_VOTES = [0.0, 0.0, 1.0, 0.1, 0.05, 0.0, 0.6, 0.7, 5.0, 5.0]


@pytest.mark.parametrize("kernel_size,pooling,expected", [
    (1, "max", [2, 6, 7, 8, 9]),  # raw votes: 2 (1.0), 7 (0.7), 6 (0.6)
    # max over 3 neighbours, window zeroed: [0, 1, 1, 1, .1, .6, .7, .7] -> 1, 2, 3
    (3, "max", [1, 2, 3, 8, 9]),
    # mean of in-row neighbours: [0, .33, .37, .38, .05, .2, .43, .43] -> 6, 7, 3
    (3, "mean", [3, 6, 7, 8, 9]),
])
def test_snapkv_pooling_changes_the_choice(kernel_size, pooling, expected):
    method = SnapKV(window=2, kernel_size=kernel_size, pooling=pooling)
    stats = AttentionStats(window_column_sums=rows(SNAP_VOTES, SNAP_VOTES))
    out = method.compress(0, make_kv([[10, 10]], 10), stats, torch.tensor([5]), "prefill")
    assert kept(out) == [[expected, expected]]  # 3 prefix tokens + the 2-token window


def test_snapkv_ragged_rows():
    votes = torch.stack([rows(SNAP_VOTES, SNAP_VOTES)[0], rows([0.5, 0.1, 0.0, 0.3, 0.2, 4.0, 4.0],
                                                               [0.2, 0.3, 0.5], capacity=10)[0]])
    kv = make_kv([[10, 10], [7, 3]], 10)
    out = SnapKV(window=2, kernel_size=3).compress(0, kv, AttentionStats(window_column_sums=votes),
                                                   torch.tensor([5, 4]), "prefill")
    # sample 1 head 0: prefix 0..4 max-pooled (window 5, 6 zeroed) = [.5, .5, .3, .3, .3] -> 0, 1 + window 5, 6;
    # head 1: 3 slots <= budget 4, all kept
    assert kept(out) == [[[1, 2, 3, 8, 9]] * 2, [[0, 1, 5, 6], [0, 1, 2]]]


def test_snapkv_does_not_compress_while_decoding():
    assert SnapKV.phases == {"prefill"}
    with pytest.raises(ConfigError, match="compress_during_decode"):
        SnapKV(compress_during_decode=True)


# -- PyramidKV ---------------------------------------------------------------------------------------------


def test_pyramidkv_budgets_by_hand():
    budgets = PyramidKV(window=4, beta=2).layer_budgets(torch.tensor([20, 13]), 4, [], 0)
    # n_keep 20: spare 16, top 16/2 = 8, bottom 32 - 8 = 24; 4 + (24 .. 8 on a line) = [28, 22.67, 17.33, 12]
    #   -> floors sum to 79, the missing 1 goes to the largest fraction (22.67)
    # n_keep 13: spare 9, top 4.5, bottom 13.5 -> [17.5, 14.5, 11.5, 8.5] -> floors 50, +2 to the lowest layers
    assert budgets.tolist() == [[28, 18], [23, 15], [17, 11], [12, 8]]


def test_pyramidkv_bottom_layer_capped_at_the_prompt():
    stats = [AttentionStats(num_queries=torch.tensor([33, 30, 100]))]
    budgets = PyramidKV(window=4, beta=8).layer_budgets(torch.tensor([20, 30, 3]), 4, stats, 0)
    # n_keep 20 of 33: spare 16, top 2, bottom 30; 4 + 30 > 33 -> bottom 29, top 32 - 29 = 3:
    #   4 + [29, 20.33, 11.67, 3] = [33, 24.33, 15.67, 7] -> floors sum to 79, +1 to 15.67
    # n_keep 30 >= prompt 30: nothing to compress, every layer 30; n_keep 3 <= window: every layer 3
    assert budgets.tolist() == [[33, 30, 3], [24, 30, 3], [16, 30, 3], [7, 30, 3]]


def test_pyramidkv_falls_back_to_uniform_budgets_on_a_short_prompt():
    # PyramidKV's code: q_len < 2 * (n_keep - window) -> every layer n_keep. n_keep 20, window 4: 2 x 16 = 32.
    # Prompt 24 < 32: uniform (the capped pyramid would be 4 + [20, 17.33, 14.67, 12]); prompt 32: the pyramid.
    stats = [AttentionStats(num_queries=torch.tensor([24, 32]))]
    budgets = PyramidKV(window=4, beta=2).layer_budgets(torch.tensor([20, 20]), 4, stats, 0)
    # prompt 32: spare 16, top 8, bottom 24; 4 + 24 = 28 <= 32: [28, 22.67, 17.33, 12] -> +1 to 22.67
    assert budgets.tolist() == [[20, 28], [20, 23], [20, 17], [20, 12]]


@pytest.mark.parametrize("n_keep", [33, 40, 100, 257, 1000])
def test_pyramidkv_budgets_sum_to_the_total_and_decrease_with_depth(n_keep):
    budgets = PyramidKV().layer_budgets(torch.tensor([n_keep]), 32, [], 0)[:, 0]
    assert int(budgets.sum()) == 32 * n_keep
    assert all(a >= b for a, b in zip(budgets.tolist(), budgets[1:].tolist()))
    assert int(budgets.min()) >= 32 and int(budgets[0]) > n_keep > int(budgets[-1])


def test_pyramidkv_selects_like_snapkv_with_its_layer_budget():
    stats = AttentionStats(window_column_sums=rows(SNAP_VOTES, SNAP_VOTES))
    out = PyramidKV(window=2, kernel_size=1).compress(3, make_kv([[10, 10]], 10), stats, torch.tensor([4]),
                                                      "prefill")
    assert kept(out) == [[[2, 7, 8, 9]] * 2]  # raw votes: 2 (1.0), 7 (0.7) + the window


# -- TOVA --------------------------------------------------------------------------------------------------

TOVA_LAST_QUERY = rows(
    [0.30, 0.00, 0.05, 0.20, 0.05, 0.12, 0.08, 0.20],  # own top 4: 0, 3, 7, 5
    [0.10, 0.40, 0.05, 0.00, 0.25, 0.12, 0.00, 0.08],  # own top 4: 1, 4, 5, 0
)  # head mean: [.20, .20, .05, .10, .15, .12, .04, .14] -> 0, 1, 4, 7


def test_tova_prefill_head_average_and_per_head():
    kv = make_kv([[8, 8]], 8)
    stats = AttentionStats(window_column_sums=TOVA_LAST_QUERY)
    assert TOVA().window == 1
    averaged = TOVA().compress(0, kv, stats, torch.tensor([4]), "prefill")
    assert kept(averaged) == [[[0, 1, 4, 7]] * 2]
    per_head = TOVA(head_average=False).compress(0, kv, stats, torch.tensor([4]), "prefill")
    assert kept(per_head) == [[[0, 3, 5, 7], [0, 1, 4, 5]]]


def test_tova_decode_evicts_the_lowest_current_attention():
    method = TOVA()
    kv = method.compress(0, make_kv([[8, 8]], 8), AttentionStats(window_column_sums=TOVA_LAST_QUERY),
                         torch.tensor([4]), "prefill")
    kv.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), torch.tensor([[8]]))
    # slots hold positions [0, 1, 4, 7, 8]; mean [.2, .2, .25, .15, .2] -> position 7 goes, although it
    # ranked above 0.12 at prefill (no accumulation)
    stats = AttentionStats(step_attention=rows([0.1, 0.3, 0.2, 0.1, 0.3], [0.3, 0.1, 0.3, 0.2, 0.1]))
    out = method.compress(0, kv, stats, torch.tensor([4]), "decode")
    assert kept(out) == [[[0, 1, 4, 8]] * 2]


def test_tova_ragged_rows():
    last_query = torch.stack([TOVA_LAST_QUERY[0], rows([0.5, 0.1, 0.3, 0.1], [0.1, 0.2, 0.3, 0.4], capacity=8)[0]])
    kv = make_kv([[8, 8], [4, 4]], 8)
    out = TOVA().compress(0, kv, AttentionStats(window_column_sums=last_query), torch.tensor([4, 2]), "prefill")
    # sample 1: 4 slots, budget 2, head mean [.3, .15, .3, .25] -> 0, 2
    assert kept(out) == [[[0, 1, 4, 7]] * 2, [[0, 2]] * 2]


# -- all methods -------------------------------------------------------------------------------------------

UNIFORM = torch.full((1, 2, 10), 0.1)
ALL_STATS = AttentionStats(column_sums=UNIFORM, window_column_sums=UNIFORM, step_attention=UNIFORM)


@pytest.mark.parametrize("method", [StreamingLLM(), H2O(), SnapKV(), PyramidKV(), TOVA()], ids=lambda m: m.name)
def test_budget_larger_than_the_row_keeps_everything(method):
    out = method.compress(0, make_kv([[10, 10]], 10), ALL_STATS, torch.tensor([20]), "prefill")
    assert kept(out) == [[list(range(10))] * 2]


@pytest.mark.parametrize("build,match", [
    (lambda: StreamingLLM(sinks=-1), "sinks=-1"),
    (lambda: StreamingLLM(sinks=1.5), "sinks=1.5"),
    (lambda: H2O(heavy_ratio=1.5), "heavy_ratio=1.5"),
    (lambda: H2O(sinks=-2), "sinks=-2"),
    (lambda: SnapKV(window=0), "window=0"),
    (lambda: SnapKV(kernel_size=4), "kernel_size=4"),
    (lambda: SnapKV(pooling="avg"), "pooling='avg'.*max, mean"),
    (lambda: PyramidKV(beta=0.5), "beta=0.5"),
    (lambda: PyramidKV(window=-3), "window=-3"),
    (lambda: TOVA(head_average="yes"), "head_average='yes'.*true, false"),
    (lambda: H2O(normalize="mean"), "normalize 'mean'.*sum, mean_over_observers"),
])
def test_bad_hyperparameters_are_rejected_with_the_value(build, match):
    with pytest.raises(ConfigError, match=match):
        build()


# -- end to end through the engine (tiny random model) --------------------------------------------------

ENGINE_METHODS = {
    "streamingllm": StreamingLLM(),
    "h2o": H2O(),
    "h2o-mean": H2O(normalize="mean_over_observers"),
    "snapkv": SnapKV(window=4),
    "pyramidkv": PyramidKV(window=4),
    "tova": TOVA(),
    "tova-per-head": TOVA(head_average=False),
}


def random_prompts(lengths: list[int], vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("method", ENGINE_METHODS.values(), ids=ENGINE_METHODS.keys())
def test_engine_realizes_the_budget(tiny_model, method):
    engine = Engine(tiny_model, method, Budget("fraction", 0.2))
    batch = random_prompts([90, 57], tiny_model.config.vocab_size)
    generations = engine.generate(batch, max_new_tokens=6, stop_token_ids=set())
    session = engine.prefill(batch, max_new_tokens=6)
    layer_n_keep = session.layer_n_keep  # (L, B)
    for b, (generation, n_keep) in enumerate(zip(generations, [18, 11])):  # 0.2 * 90, 0.2 * 57 rounded
        assert generation.n_keep == n_keep
        for layer, heads in enumerate(generation.kept_per_layer_head):
            assert all(abs(kept_slots - int(layer_n_keep[layer, b])) <= 1 for kept_slots in heads)
    if isinstance(method, PyramidKV):  # lower layer keeps more, the mean stays n_keep
        # n_keep 18: spare 14, top 0.7, bottom 27.3 -> [31.3, 4.7] -> [31, 5];
        # n_keep 11: spare 7, top 0.35, bottom 13.65 -> [17.65, 4.35] -> [18, 4]
        assert layer_n_keep.tolist() == [[31, 18], [5, 4]]
    else:
        assert layer_n_keep.tolist() == [[18, 11], [18, 11]]
    for step in range(4):
        session.feed(torch.tensor([[5], [6]]))
        growth = 0 if method.compress_during_decode else step + 1
        assert (session.cache.lengths() == layer_n_keep.unsqueeze(-1) + growth).all()


@pytest.mark.parametrize("method", [H2O(), SnapKV(window=4), TOVA()], ids=lambda m: m.name)
def test_engine_batch_keeps_the_same_tokens_as_alone(tiny_model, method):
    """Left padding must not leak into the prompt statistics: a row keeps what it keeps when run alone."""
    engine = Engine(tiny_model, method, Budget("fraction", 0.2))
    batch = random_prompts([90, 57], tiny_model.config.vocab_size)
    together = engine.prefill(batch, max_new_tokens=1).cache
    for b, prompt in enumerate(batch):
        alone = engine.prefill([prompt], max_new_tokens=1).cache
        for layer in range(tiny_model.config.num_hidden_layers):
            assert kept(together.kv(layer))[b] == kept(alone.kv(layer))[0]
