"""Prefill: logits for the last position only, per-layer compression inside the prompt pass, chunked prefill."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import pytest
import torch

from kvbench.budget import Budget
from kvbench.cache import CompressedCache
from kvbench.engine import Engine
from kvbench.errors import ConfigError
from kvbench.kernels.dispatch import use_backend
from kvbench.methods.d2o import D2O
from kvbench.methods.full import Full
from kvbench.methods.h2o import H2O


def prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass
class RecordingH2O(H2O):
    """H2O that keeps the column sums it was given at each prefill compression of layer 0."""

    name: ClassVar[str] = "recording_h2o"
    seen: list = field(default_factory=list)

    def compress(self, layer, kv, stats, n_keep, phase, host=None):
        if layer == 0 and phase == "prefill":
            n = int(kv.lengths[0, 0])
            self.seen.append((kv.positions[0, :, :n].clone(), stats.column_sums[0, :, :n].clone()))
        return super().compress(layer, kv, stats, n_keep, phase, host)


def cache_capacities_at_each_layer(engine: Engine, tokens: list[int], monkeypatch) -> list[list[int | None]]:
    """For every layer's cache write in the prompt pass (each decoder layer's attention, in order): the storage
    capacity of every cache layer just before it. Observed through ``CompressedCache.update``, the one call
    every layer makes, whatever keyword the model's layers take the cache by."""
    seen, update = [], CompressedCache.update

    def recording_update(cache, key_states, value_states, layer_idx, *args, **kwargs):
        seen.append([None if layer.kv is None else layer.kv.capacity for layer in cache.layers])
        return update(cache, key_states, value_states, layer_idx, *args, **kwargs)

    monkeypatch.setattr(CompressedCache, "update", recording_update)
    engine.prefill([tokens], max_new_tokens=0)
    return seen


def test_prompt_pass_computes_logits_of_the_last_position_only(tiny_model):
    shapes = []
    hook = tiny_model.lm_head.register_forward_hook(lambda m, i, out: shapes.append(tuple(out.shape)))
    try:
        session = Engine(tiny_model, Full(), Budget("fraction", 1.0)).prefill([prompt(40, 200)], 4)
    finally:
        hook.remove()
    assert shapes == [(1, 1, tiny_model.config.vocab_size)]
    assert session.logits.shape == (1, tiny_model.config.vocab_size)


def test_each_layer_is_compressed_before_the_next_layer_runs(tiny_model, monkeypatch):
    engine = Engine(tiny_model, H2O(), Budget("tokens", 10))
    # layer 1 starts after layer 0 was compressed to its budget, not holding the 50 prompt tokens
    assert cache_capacities_at_each_layer(engine, prompt(50, 200), monkeypatch) == [[None, None], [10, None]]


def test_a_method_whose_budgets_need_every_layer_compresses_after_the_pass(tiny_model, monkeypatch):
    engine = Engine(tiny_model, D2O(), Budget("tokens", 10))
    assert cache_capacities_at_each_layer(engine, prompt(50, 200), monkeypatch) == [[None, None], [50, None]]


def test_chunked_prefill_sums_attention_over_every_prompt_query(tiny_model):
    """With a budget that evicts nothing, the chunks' accumulated column sums are the one-pass column sums."""
    tokens = prompt(50, 200)
    with use_backend("torch"):
        whole, chunked = RecordingH2O(), RecordingH2O()
        Engine(tiny_model, whole, Budget("tokens", 64)).prefill([tokens], 2)
        Engine(tiny_model, chunked, Budget("tokens", 64), prefill_chunk_size=16).prefill([tokens], 2)
    assert len(whole.seen) == 1 and len(chunked.seen) == 4  # chunks of 16, 16, 16, 2
    positions, sums = chunked.seen[-1]
    assert positions.tolist() == whole.seen[0][0].tolist()
    torch.testing.assert_close(sums, whole.seen[0][1], atol=1e-5, rtol=1e-5)
    # after the first chunk, every slot has been seen by the 16 queries at or after it: sums of 1..16 rows
    first_positions, first_sums = chunked.seen[0]
    torch.testing.assert_close(first_sums.sum(-1), torch.full((2,), 16.0), atol=1e-5, rtol=0)


def test_chunked_prefill_keeps_the_budget_between_chunks(tiny_model):
    method = RecordingH2O()
    session = Engine(tiny_model, method, Budget("tokens", 8), prefill_chunk_size=10).prefill([prompt(45, 200)], 3)
    assert [len(p[0]) for p, _ in method.seen] == [10, 18, 18, 18, 13]  # 8 kept + the next chunk
    assert session.cache.lengths().max() == 8


def test_chunked_full_cache_equals_one_pass(tiny_model):
    tokens = prompt(50, 200)
    with use_backend("torch"):
        one = Engine(tiny_model, Full(), Budget("fraction", 1.0)).prefill([tokens], 2).logits
        chunked = Engine(tiny_model, Full(), Budget("fraction", 1.0), prefill_chunk_size=7).prefill([tokens], 2)
    torch.testing.assert_close(chunked.logits, one, atol=1e-5, rtol=1e-5)


def test_a_chunk_as_long_as_the_prompt_is_one_pass(tiny_model):
    tokens = prompt(50, 200)
    with use_backend("torch"):
        gens = [Engine(tiny_model, H2O(), Budget("tokens", 12), prefill_chunk_size=size).generate(
            [tokens], 10, stop_token_ids=set())[0].tokens for size in (None, 50, 500)]
    assert gens[0] == gens[1] == gens[2]


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "abc"])
def test_bad_chunk_size_is_refused(tiny_model, value):
    with pytest.raises(ConfigError, match=f"engine.prefill_chunk_size={value!r}; accepted"):
        Engine(tiny_model, Full(), Budget("fraction", 1.0), prefill_chunk_size=value)


def test_cuda_graphs_need_a_cuda_model(tiny_model):
    with pytest.raises(ConfigError, match="cuda_graphs=true needs a CUDA model"):
        Engine(tiny_model, Full(), Budget("fraction", 1.0), cuda_graphs=True)
