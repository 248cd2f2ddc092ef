"""One prompt pass for several points (``kvbench.shared_prefill``): the points of one method at several budgets
compress together, as the rows of one ``compress`` call, and each point's row is exactly its row alone."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from kvbench import shared_prefill
from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.shared_prefill import prefill_points
from tests.test_decode_paths import CASES, METHODS, build, random_prompts

BUDGETS = (0.2, 0.35, 0.5)


def assert_same_layer(got, want, where: str, exact: bool = True) -> None:
    """Real slots, lengths, state and tables equal; capacities may differ (each row is re-planned after).
    ``exact=False``: floats to float32 rounding (CUDA merges add with atomics, in no fixed order)."""
    assert torch.equal(got.kv.lengths, want.kv.lengths), where
    assert (got.host_lengths == want.host_lengths).all(), where
    valid = want.kv.valid()
    for name, a, b in [("keys", got.kv.keys, want.kv.keys), ("values", got.kv.values, want.kv.values),
                       ("positions", got.kv.positions, want.kv.positions),
                       *((f"state {n}", got.kv.state[n], s) for n, s in want.kv.state.items())]:
        width = min(a.shape[2], b.shape[2])
        assert width >= int(want.kv.lengths.max()), where
        mask = valid[:, :, :width]
        if exact or not a.is_floating_point():
            assert torch.equal(a[:, :, :width][mask], b[:, :, :width][mask]), f"{where}: {name}"
        else:
            torch.testing.assert_close(a[:, :, :width][mask], b[:, :, :width][mask], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{where}: {name}: {m}")
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

    def picky(self, layer, kv, stats, n_keep, phase, host=None):
        if (n_keep == 12).any():
            raise ValueError("n_keep 12 rejected")
        return compress(self, layer, kv, stats, n_keep, phase, host)

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

    def together_fails_at_layer_1(self, layer, kv, stats, n_keep, phase, host=None):
        if layer == 1 and kv.keys.shape[0] > 1:
            raise RuntimeError("layer 1 together")
        return compress(self, layer, kv, stats, n_keep, phase, host)

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


def test_compressions_overlapped_with_the_pass_give_the_rows_in_line(tiny_model):
    """``overlap=True`` (a worker thread beside the pass): every method, deferred ones included, at two budgets in
    one group: each point's row as the in-line pass gives it."""
    engines = [Engine(tiny_model, build(name), Budget("fraction", b)) for name in METHODS for b in (0.2, 0.5)]
    prompt = random_prompts([61], tiny_model.config.vocab_size, seed=7)[0]
    in_line = prefill_points(engines, prompt, 6, [], overlap=False)
    overlapped = prefill_points(engines, prompt, 6, [], overlap=True)
    for engine, got, want in zip(engines, overlapped, in_line):
        assert not isinstance(got, Exception) and not isinstance(want, Exception), (got, want)
        for layer, (a, b) in enumerate(zip(got.cache.layers, want.cache.layers)):
            assert_same_layer(a, b, f"{engine.method.name} {engine.budget.value} layer {layer}")
        assert torch.equal(got.logits, want.logits)
        assert torch.equal(got.layer_n_keep, want.layer_n_keep)


def test_an_overlapped_pass_re_raises_what_its_worker_raised(tiny_model, monkeypatch):
    """A failure outside any one point's compression (which each point would get as its own error) ends the
    pass with it, and the worker's thread is gone."""
    before = {t.name for t in threading.enumerate()}

    def broken(self, layer, kv, stats):
        raise RuntimeError(f"worker failed at layer {layer}")

    monkeypatch.setattr(shared_prefill._SharedPass, "compress_groups", broken)
    engines = [Engine(tiny_model, build("h2o"), Budget("fraction", b)) for b in BUDGETS]
    prompt = random_prompts([30], tiny_model.config.vocab_size, seed=5)[0]
    with pytest.raises(RuntimeError, match="worker failed at layer 0"):
        prefill_points(engines, prompt, 4, [], overlap=True)
    assert "kvbench-compress" not in {t.name for t in threading.enumerate()} - before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_overlapped_compressions_give_the_rows_in_line():
    """The worker launches on the pass's stream, interleaved with the next layers: the same kernels on the same
    tensors, so the same slots, and floats equal but for the order of atomic additions (Chelsea's merges) (the
    GPU runs, ``scripts/gpu_session.sh tests``)."""
    from kvbench import models
    from tests.conftest import tiny_model_config

    model = models.load(tiny_model_config(device="cuda")).model
    engines = [Engine(model, build(name), Budget("fraction", b)) for name in METHODS for b in (0.2, 0.5)]
    prompt = random_prompts([301], model.config.vocab_size, seed=7)[0]
    in_line = prefill_points(engines, prompt, 6, [], overlap=False)
    overlapped = prefill_points(engines, prompt, 6, [])
    for engine, got, want in zip(engines, overlapped, in_line):
        assert not isinstance(got, Exception) and not isinstance(want, Exception), (got, want)
        for layer, (a, b) in enumerate(zip(got.cache.layers, want.cache.layers)):
            assert_same_layer(a, b, f"{engine.method.name} {engine.budget.value} layer {layer}", exact=False)


@pytest.mark.parametrize("name", ["pyramidkv", "d2o"])
def test_a_rows_layer_budgets_on_the_host_are_those_on_the_device(tiny_model, name):
    """Budgets known before the pass (PyramidKV's) and after it (D2O's), for a row prefilled alone and for every
    point of a shared pass: the host copy that eviction decides with (``host_n_keep``) is the device's."""
    engines = [Engine(tiny_model, build(name), Budget("fraction", b)) for b in BUDGETS]
    prompt = random_prompts([301], tiny_model.config.vocab_size, seed=3)[0]
    rows = [engines[0].prefill_row(prompt, 6), *prefill_points(engines, prompt, 6, [])]
    for row in rows:
        assert not isinstance(row, Exception), row
        assert (row.host_n_keep == row.layer_n_keep.cpu().numpy()).all()
        assert len(set(row.host_n_keep[:, 0].tolist())) > 1  # layer-adaptive: not one budget copied everywhere


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["h2o", "pyramidkv"])
def test_on_cuda_a_new_rows_budgets_reach_the_device_without_a_wait(name):
    """A prompt pass's row and its layer budgets, computed on the host, are copied to the device without
    synchronising: a shared pass makes one row per point (the GPU runs, ``scripts/gpu_session.sh tests``)."""
    from kvbench import models
    from kvbench.engine import DeviceTimer
    from tests.conftest import tiny_model_config

    engine = Engine(models.load(tiny_model_config(device="cuda")).model, build(name), Budget("fraction", 0.2))
    n_keep = engine.budget.n_keep(torch.tensor([301]), 6, engine.method.budget_basis)
    torch.cuda.set_sync_debug_mode("error")
    try:
        session = engine.new_row(301, DeviceTimer(engine.device))
        session.set_layer_budgets(engine.budgets_before_pass(n_keep, 301, 6))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (session.host_n_keep == session.layer_n_keep.cpu().numpy()).all()
    assert int(session.next_index) == 301


def test_sets_over_every_query_share_one_column_sum_pass(tiny_model, monkeypatch):
    """H2O's column sums and EMS's column and window sums come from one column-sum pass a layer (its column sums
    do not depend on the window); D2O's per-query-head sums and SnapKV's window alone keep a pass each; every
    point's row is still its row alone."""
    from kvbench import attention

    calls = []
    column_sums = attention.column_sums_from_lse

    def counted(query, keys, *args, **kwargs):
        calls.append((query.shape[2], keys.shape[1]))
        return column_sums(query, keys, *args, **kwargs)

    monkeypatch.setattr(attention, "column_sums_from_lse", counted)
    engines = [Engine(tiny_model, build(name), Budget("fraction", 0.35)) for name in ("h2o", "ems", "d2o", "snapkv")]
    prompt = random_prompts([61], tiny_model.config.vocab_size, seed=9)[0]
    rows = prefill_points(engines, prompt, 6, [])
    layers = tiny_model.config.num_hidden_layers
    heads = tiny_model.config.num_attention_heads
    kv_heads = tiny_model.config.num_key_value_heads
    every_query = [c for c in calls if c[0] == len(prompt)]
    assert len(calls) == 3 * layers  # before: H2O's set and EMS's set each had a pass of their own (4 a layer)
    assert sorted(set(every_query)) == sorted({(len(prompt), kv_heads), (len(prompt), heads)})
    assert len(every_query) == 2 * layers
    for engine, row in zip(engines, rows):
        alone = engine.prefill_row(prompt, 6)
        for layer, (got, want) in enumerate(zip(row.cache.layers, alone.cache.layers)):
            assert_same_layer(got, want, f"{engine.method.name} layer {layer}")


def suffix_rows(model, monkeypatch):
    """Every method at two budgets prefilled with a suffix: (engines, rows, prompt, suffix, the shapes of the
    passes that fed several rows at once)."""
    from kvbench.engine import Session

    passes = []
    together = Session.feed_together
    monkeypatch.setattr(Session, "feed_together", staticmethod(
        lambda sessions, tokens, *args, **kwargs: passes.append(tuple(tokens.shape)) or together(
            sessions, tokens, *args, **kwargs)))
    engines = [Engine(model, build(name), Budget("fraction", b)) for name in METHODS for b in (0.2, 0.5)]
    prompt, suffix = random_prompts([61, 9], model.config.vocab_size, seed=11)
    return engines, prefill_points(engines, prompt, 6, suffix), prompt, suffix, passes


def test_on_a_cpu_each_points_suffix_is_fed_on_its_row_as_alone(tiny_model, monkeypatch):
    """Query-agnostic prompts on a CPU: the question (suffix) is fed row by row (a GEMM of more rows rounds a
    row's last bits differently), so every method's row, state and logits are exactly those it gets alone."""
    engines, rows, prompt, suffix, passes = suffix_rows(tiny_model, monkeypatch)
    assert passes == []
    for engine, row in zip(engines, rows):
        assert not isinstance(row, Exception), row
        alone = engine.prefill_row(prompt, 6, suffix)
        for layer, (got, want) in enumerate(zip(row.cache.layers, alone.cache.layers)):
            assert_same_layer(got, want, f"{engine.method.name} {engine.budget.value} layer {layer}")
        assert torch.equal(row.logits, alone.logits), engine.method.name
        assert torch.equal(row.next_index, alone.next_index)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_every_points_suffix_goes_through_one_pass(monkeypatch):
    """On CUDA the suffix of every point's row goes through one forward pass (``Session.feed_together``), each row
    attending over its own cache: the rows are those the same shared pass gives feeding each suffix alone, but
    for the GEMMs' rounding of more rows (the GPU runs, ``scripts/gpu_session.sh tests``)."""
    from kvbench import models
    from kvbench.engine import Session
    from tests.conftest import tiny_model_config

    model = models.load(tiny_model_config(device="cuda")).model
    engines, rows, prompt, suffix, passes = suffix_rows(model, monkeypatch)
    assert passes == [(len(engines), len(suffix))]
    monkeypatch.setattr(Session, "feed_together", staticmethod(  # each row's suffix through a pass of its own
        lambda sessions, tokens, phase, *args: [s.feed(tokens[:1], phase) for s in sessions]))
    one_by_one = prefill_points(engines, prompt, 6, suffix)
    for engine, row, own_pass in zip(engines, rows, one_by_one):
        assert not isinstance(row, Exception) and not isinstance(own_pass, Exception), (row, own_pass)
        assert torch.equal(row.next_index, own_pass.next_index)
        for layer, (got, want) in enumerate(zip(row.cache.layers, own_pass.cache.layers)):
            where = f"{engine.method.name} {engine.budget.value} layer {layer}"
            assert torch.equal(got.kv.lengths, want.kv.lengths), where
            n = int(want.kv.lengths.max())
            assert torch.equal(got.kv.positions[:, :, :n], want.kv.positions[:, :, :n]), where
            for a, b in ((got.kv.keys, want.kv.keys), (got.kv.values, want.kv.values)):
                torch.testing.assert_close(a[:, :, :n].float(), b[:, :, :n].float(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(row.logits.float(), own_pass.logits.float(), rtol=1e-4, atol=1e-4)
