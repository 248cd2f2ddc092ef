"""One prompt pass for several (method, budget) points: every point's prefilled row from the same forward.

The points' engines share the model and everything the prompt pass depends on (attention implementation,
position mode, one pass per prompt: no ``prefill_chunk_size``); ``kvbench.sweep`` decides which points may.
The pass computes the union of the statistics the methods ask for, each (statistics, window) set exactly as
a pass asking for it alone computes it (``PassPlan.stat_sets``). On the CPU the forward that also returns the
log-sum-exp runs the very kernel sdpa runs, so every point's row is the row ``Engine.prefill`` gives it alone;
on CUDA a point without column sums runs sdpa alone and cuDNN's attention here: the last bits may differ.

After each layer's attention, every point whose layer budgets need no statistics compresses its own shallow
copy of the layer (fresh state and tables: methods assign state on their input; a result that still holds the
pass's tensors, such as the full cache, is cloned), and the pass's uncompressed layer is dropped: peak memory is
one uncompressed layer plus the points' compressed caches. A point whose budgets need every layer's statistics
(``Method.budget_needs``, D2O) compresses after the pass, so the prompt cache is then held until the pass ends,
as when it runs alone. A point whose compression raises gets its error instead of a row; the others go on.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from kvbench.cache import CompressedCache, PassPlan
from kvbench.engine import DeviceTimer, Engine, Session, _sync
from kvbench.kv import AttentionStats, LayerKV


def prefill_points(engines: list[Engine], prompt: list[int], max_new_tokens: int,
                   suffix: list[int]) -> list[Session | Exception]:
    """Prefill ``prompt`` once for every engine (one per point); each point's ``suffix`` is fed on its own
    compressed row. Returns per engine its prefilled one-row session (the unit ``Engine.prefill_row`` returns),
    whose ``prefill_seconds`` are the whole shared pass plus its own compression and suffix, or the error its
    compression or suffix raised."""
    lead, n = engines[0], len(prompt)
    L, device = lead.num_layers, lead.device
    timers = [DeviceTimer(device) for _ in engines]
    sessions = [engine.new_row(n, timer) for engine, timer in zip(engines, timers)]
    n_keeps = [engine.budget.n_keep(torch.tensor([n]), max_new_tokens, engine.method.budget_basis)
               for engine in engines]
    deferred = [bool(engine.method.budget_needs) for engine in engines]
    for engine, session, n_keep, later in zip(engines, sessions, n_keeps, deferred):
        if not later:
            session.layer_n_keep = engine.budgets_before_pass(n_keep, n, max_new_tokens)
    requests = [(engine.method.needs, engine.method.window) for engine in engines]
    stat_sets = tuple(dict.fromkeys(requests))
    kept_stats = [[None] * L for _ in engines]  # the deferred points' statistics, every layer's
    errors: list[Exception | None] = [None] * len(engines)
    cache, shared = CompressedCache(L), _SharedStorage()

    def compress_layer(layer: int) -> None:
        kv, stats = cache.kv(layer), cache.set_stats[layer]
        shared.add(kv)
        for i, (engine, session) in enumerate(zip(engines, sessions)):
            if errors[i] is not None:
                continue
            fork = LayerKV(keys=kv.keys, values=kv.values, positions=kv.positions, lengths=kv.lengths)
            own_stats = dataclasses.replace(stats[stat_sets.index(requests[i])])
            try:
                own_stats = engine.with_raw_keys(fork, own_stats, engine.method.needs)
                if deferred[i]:
                    session.cache.set_kv(layer, fork)
                    kept_stats[i][layer] = own_stats
                else:
                    engine.compress_prompt_layer(session, layer, fork, own_stats, own=shared.private)
            except Exception as err:  # noqa: BLE001 - one point's failure leaves the others' rows intact
                errors[i] = err
        cache.layers[layer].kv, cache.set_stats[layer] = None, []  # the uncompressed layer, freed

    index = torch.arange(n, device=device).view(1, -1)
    plan = PassPlan(query_positions=index, num_queries=torch.tensor([n], device=device), stat_sets=stat_sets,
                    after_layer=compress_layer)
    _sync(device)
    t0 = time.perf_counter()
    logits = lead._forward(torch.tensor([prompt], device=device), index, index, cache, plan, logits_to_keep=1)
    _sync(device)
    in_pass = [timer.total("compress") for timer in timers]  # each point's compression inside the pass
    shared_seconds = time.perf_counter() - t0 - sum(in_pass)
    rows = []
    for i, (engine, session) in enumerate(zip(engines, sessions)):
        t1 = time.perf_counter()
        try:
            if errors[i] is not None:
                raise errors[i]
            if deferred[i]:
                engine.compress_after_pass(session, n_keeps[i], kept_stats[i], max_new_tokens, own=shared.private)
            engine.finish_row(session, n, logits, suffix, max_new_tokens)
        except Exception as err:  # noqa: BLE001 - as above
            rows.append(err)
            continue
        _sync(device)
        session.prefill_seconds = shared_seconds + in_pass[i] + time.perf_counter() - t1
        rows.append(session)
    return rows


class _SharedStorage:
    """The storages of the pass's uncompressed layers, so that a point's result still holding one (a method
    may return its input: the full cache, WeightedKV under budget) gets tensors of its own."""

    def __init__(self) -> None:
        self.pointers: set[int] = set()

    def add(self, kv: LayerKV) -> None:
        self.pointers.update(t.untyped_storage().data_ptr() for t in (kv.keys, kv.values, kv.positions, kv.lengths))

    def private(self, kv: LayerKV) -> LayerKV:
        tensors = {"keys": kv.keys, "values": kv.values, "positions": kv.positions, "lengths": kv.lengths}
        shared = {name for name, t in tensors.items() if t.untyped_storage().data_ptr() in self.pointers}
        if not shared:
            return kv
        return dataclasses.replace(kv, **{name: tensors[name].clone() for name in shared})
