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
from kvbench.kv import LayerKV


def prefill_points(engines: list[Engine], prompt: list[int], max_new_tokens: int,
                   suffix: list[int]) -> list[Session | Exception]:
    """Prefill ``prompt`` once for every engine (one per point); each point's ``suffix`` is fed on its own
    compressed row. Returns per engine its prefilled one-row session (the unit ``Engine.prefill_row`` returns),
    whose ``prefill_seconds`` are the whole shared pass plus its own compression and suffix, or the error its
    compression or suffix raised."""
    shared = _SharedPass(engines, len(prompt), max_new_tokens)
    device = engines[0].device
    index = torch.arange(len(prompt), device=device).view(1, -1)
    plan = PassPlan(query_positions=index, num_queries=torch.tensor([len(prompt)], device=device),
                    stat_sets=shared.stat_sets, after_layer=shared.compress_layer)
    _sync(device)
    t0 = time.perf_counter()
    logits = engines[0]._forward(torch.tensor([prompt], device=device), index, index, shared.cache, plan,
                                 logits_to_keep=1)
    _sync(device)
    in_pass = [timer.total("compress") for timer in shared.timers]  # each point's compression inside the pass
    return shared.finish(logits, suffix, time.perf_counter() - t0 - sum(in_pass), in_pass)


class _SharedPass:
    """The points' rows while the shared pass runs: after each layer every point compresses its copy of it."""

    def __init__(self, engines: list[Engine], n: int, max_new_tokens: int) -> None:
        self.engines, self.n, self.max_new_tokens = engines, n, max_new_tokens
        L, device = engines[0].num_layers, engines[0].device
        self.timers = [DeviceTimer(device) for _ in engines]
        self.sessions = [engine.new_row(n, timer) for engine, timer in zip(engines, self.timers)]
        self.n_keeps = [engine.budget.n_keep(torch.tensor([n]), max_new_tokens, engine.method.budget_basis)
                        for engine in engines]
        self.deferred = [bool(engine.method.budget_needs) for engine in engines]
        for engine, session, n_keep, later in zip(engines, self.sessions, self.n_keeps, self.deferred):
            if not later:
                session.layer_n_keep = engine.budgets_before_pass(n_keep, n, max_new_tokens)
        self.requests = [(engine.method.needs, engine.method.window) for engine in engines]
        self.stat_sets = tuple(dict.fromkeys(self.requests))
        self.kept_stats = [[None] * L for _ in engines]  # the deferred points' statistics, every layer's
        self.errors: list[Exception | None] = [None] * len(engines)
        self.cache = CompressedCache(L)  # the pass's own: each uncompressed layer until the points took it
        self.pointers: list[set[int]] = [set() for _ in range(L)]  # storages of each uncompressed layer

    def compress_layer(self, layer: int) -> None:
        """``PassPlan.after_layer``: every point's copy of the layer compressed (or kept, for a deferred point);
        then the pass drops the uncompressed layer."""
        kv, stats = self.cache.kv(layer), self.cache.set_stats[layer]
        self.pointers[layer] = {t.untyped_storage().data_ptr() for t in (kv.keys, kv.values, kv.positions,
                                                                         kv.lengths)}
        for i, (engine, session) in enumerate(zip(self.engines, self.sessions)):
            if self.errors[i] is not None:
                continue
            fork = LayerKV(keys=kv.keys, values=kv.values, positions=kv.positions, lengths=kv.lengths)
            own_stats = dataclasses.replace(stats[self.stat_sets.index(self.requests[i])])
            try:
                own_stats = engine.with_raw_keys(fork, own_stats, engine.method.needs)
                if self.deferred[i]:
                    session.cache.set_kv(layer, fork)
                    self.kept_stats[i][layer] = own_stats
                else:
                    engine.compress_prompt_layer(session, layer, fork, own_stats, own=self.private)
            except Exception as err:  # noqa: BLE001 - one point's failure leaves the others' rows intact
                self.errors[i] = err
        self.cache.layers[layer].kv, self.cache.set_stats[layer] = None, []

    def private(self, layer: int, kv: LayerKV) -> LayerKV:
        """``kv`` with tensors of its own where it still holds the pass's layer ``layer`` (a method may return its
        input: the full cache, WeightedKV under budget)."""
        tensors = {"keys": kv.keys, "values": kv.values, "positions": kv.positions, "lengths": kv.lengths}
        shared = {name for name, t in tensors.items() if t.untyped_storage().data_ptr() in self.pointers[layer]}
        return dataclasses.replace(kv, **{name: tensors[name].clone() for name in shared}) if shared else kv

    def finish(self, logits: torch.Tensor, suffix: list[int], shared_seconds: float,
               in_pass: list[float]) -> list[Session | Exception]:
        """After the pass: the deferred points' compression, then every row finished (``Engine.finish_row``) and
        timed. logits: (1, 1, V) of the prompt's last token."""
        rows = []
        for i, (engine, session) in enumerate(zip(self.engines, self.sessions)):
            t1 = time.perf_counter()
            try:
                if self.errors[i] is not None:
                    raise self.errors[i]
                if self.deferred[i]:
                    engine.compress_after_pass(session, self.n_keeps[i], self.kept_stats[i], self.max_new_tokens,
                                               own=self.private)
                engine.finish_row(session, self.n, logits, suffix, self.max_new_tokens)
            except Exception as err:  # noqa: BLE001 - as in compress_layer
                rows.append(err)
                continue
            _sync(session.engine.device)
            session.prefill_seconds = shared_seconds + in_pass[i] + time.perf_counter() - t1
            rows.append(session)
        return rows
