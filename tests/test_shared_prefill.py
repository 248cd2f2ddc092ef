"""One prompt pass for several points (``kvbench.shared_prefill``): the points of one method at several budgets
compress together, as the rows of one ``compress`` call, and each point's row is exactly its row alone."""

from __future__ import annotations

import logging

import pytest
import torch

from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.shared_prefill import prefill_points
from tests.test_decode_paths import CASES, build, random_prompts

BUDGETS = (0.2, 0.35, 0.5)


def assert_same_layer(got, want, where: str) -> None:
    """Real slots, lengths, state and tables equal; capacities may differ (each row is re-planned after)."""
    assert torch.equal(got.kv.lengths, want.kv.lengths), where
    assert (got.host_lengths == want.host_lengths).all(), where
    valid = want.kv.valid()
    for name, a, b in [("keys", got.kv.keys, want.kv.keys), ("values", got.kv.values, want.kv.values),
                       ("positions", got.kv.positions, want.kv.positions),
                       *((f"state {n}", got.kv.state[n], s) for n, s in want.kv.state.items())]:
        width = min(a.shape[2], b.shape[2])
        assert width >= int(want.kv.lengths.max()), where
        mask = valid[:, :, :width]
        assert torch.equal(a[:, :, :width][mask], b[:, :, :width][mask]), f"{where}: {name}"
    assert set(got.kv.state) == set(want.kv.state) and set(got.kv.tables) == set(want.kv.tables), where
    for name, table in want.kv.tables.items():
        assert torch.equal(got.kv.tables[name], table), f"{where}: table {name}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_methods_budgets_compress_together_into_each_points_row_alone(tiny_model, case, caplog):
    engines = [Engine(tiny_model, build(case), Budget("fraction", b)) for b in BUDGETS]
    prompt = random_prompts([61], tiny_model.config.vocab_size, seed=4)[0]
    with caplog.at_level(logging.INFO, logger="kvbench"):
        rows = prefill_points(engines, prompt, 6, [])
    alones = [engine.prefill_row(prompt, 6) for engine in engines]
    assert "compress one by one" not in caplog.text
    for engine, row, alone in zip(engines, rows, alones):
        for layer, (got, want) in enumerate(zip(row.cache.layers, alone.cache.layers)):
            assert_same_layer(got, want, f"{case} budget {engine.budget.value} layer {layer}")
        assert torch.equal(row.logits, alone.logits)
        assert row.compress_seconds > 0


def test_a_call_together_that_raises_leaves_each_point_its_own_row_or_error(tiny_model, monkeypatch, caplog):
    """The points then compress one by one: the budget the method rejects fails its own point only."""
    method = build("h2o")
    compress = type(method).compress

    def picky(self, layer, kv, stats, n_keep, phase):
        if (n_keep == 12).any():
            raise ValueError("n_keep 12 rejected")
        return compress(self, layer, kv, stats, n_keep, phase)

    monkeypatch.setattr(type(method), "compress", picky)
    engines = [Engine(tiny_model, build("h2o"), Budget("tokens", n)) for n in (8, 12, 20)]
    prompt = random_prompts([40], tiny_model.config.vocab_size, seed=5)[0]
    with caplog.at_level(logging.INFO, logger="kvbench"):
        rows = prefill_points(engines, prompt, 4, [])
    assert "h2o: 3 points compress one by one from layer 0 on" in caplog.text
    assert isinstance(rows[1], ValueError) and "n_keep 12" in str(rows[1])
    for i in (0, 2):
        alone = engines[i].prefill_row(prompt, 4)
        for layer, (got, want) in enumerate(zip(rows[i].cache.layers, alone.cache.layers)):
            assert_same_layer(got, want, f"point {i} layer {layer}")


def test_deferred_points_whose_call_together_raises_go_on_one_by_one_from_that_layer(tiny_model, monkeypatch,
                                                                                    caplog):
    """D2O's budgets compress together after the pass; a call that raises at layer 1 leaves layer 0 as it was
    compressed together, and every point compresses layer 1 on its own: each row is still its row alone."""
    method = build("d2o")
    compress = type(method).compress

    def together_fails_at_layer_1(self, layer, kv, stats, n_keep, phase):
        if layer == 1 and kv.keys.shape[0] > 1:
            raise RuntimeError("layer 1 together")
        return compress(self, layer, kv, stats, n_keep, phase)

    monkeypatch.setattr(type(method), "compress", together_fails_at_layer_1)
    engines = [Engine(tiny_model, build("d2o"), Budget("fraction", b)) for b in BUDGETS]
    prompt = random_prompts([61], tiny_model.config.vocab_size, seed=4)[0]
    with caplog.at_level(logging.INFO, logger="kvbench"):
        rows = prefill_points(engines, prompt, 6, [])
    assert "d2o: 3 points compress one by one from layer 1 on (together: RuntimeError('layer 1 together'))" \
        in caplog.text
    for engine, row in zip(engines, rows):
        alone = engine.prefill_row(prompt, 6)
        for layer, (got, want) in enumerate(zip(row.cache.layers, alone.cache.layers)):
            assert_same_layer(got, want, f"budget {engine.budget.value} layer {layer}")
        assert torch.equal(row.layer_n_keep, alone.layer_n_keep)
