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
one uncompressed layer plus the points' compressed caches. On CUDA the compressions run beside the pass, on a
host thread of their own (``kvbench.overlap``: the device runs the next layers while the host plans a
compression), and up to ``overlap.DEPTH + 2`` uncompressed layers are held; a point's compression time then
runs from its first kernel to its last on the device, the next layers' kernels among them, and the pass counts
the rest of the wall. Every compression gets the sizes the host knows (``kv.HostSizes``: the points' budgets, the
pass's lengths) and installs the lengths ``Method.kept_lengths`` gives, so it reads nothing back unless the data
decide its sizes (KVMerger's sets): a read would wait for the next layers the pass has queued (a 34-point pass at
16k on an H200: 73 waits instead of 1,263, the pass 2.05 s instead of 2.62 s). Points of one method that differ only
in their budget (``method=h2o budget=0.2,0.35,0.5``) compress together, as the rows of one ``compress`` call over
the layer broadcast to as many rows (views, no copy), each row at its own point's budget: a method computes every
row on its own, so each point's row is the one it gets alone, at a third of the kernel launches for three budgets (a
prompt compression is mostly launches on a GPU). Each shares the call's time equally. A row's tables come cut to the
size they have alone (``Method.batch_row``: EMS's look-up table, which one call sizes for its largest budget).
Should the call raise, its points compress one by one, so that each gets its own row or error. A point whose budgets
need every layer's statistics (``Method.budget_needs``, D2O) compresses after the pass, so the prompt cache is then
held until the pass ends, as when it runs alone; a method's deferred points compress together there, each at its own
layer budgets. A point whose compression raises gets its error instead of a row; the others go on. A prompt's suffix
(the question of a query-agnostic prompt) goes, on CUDA, through one pass for every point's row
(``Session.feed_together``), each row attending over its own compressed cache.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch

from kvbench.cache import CompressedCache, PassPlan
from kvbench.engine import DeviceTimer, Engine, Session, _sync, clock_mark
from kvbench.kv import AttentionStats, HostSizes, LayerKV
from kvbench.overlap import LayerWorker

log = logging.getLogger("kvbench")


def prefill_points(engines: list[Engine], prompt: list[int], max_new_tokens: int, suffix: list[int],
                   overlap: bool | None = None) -> list[Session | Exception]:
    """Prefill ``prompt`` once for every engine (one per point); each point's ``suffix`` is fed on its own
    compressed row. Returns per engine its prefilled one-row session (the unit ``Engine.prefill_row`` returns),
    whose ``prefill_seconds`` are the whole shared pass plus its own compression and suffix, or the error its
    compression or suffix raised. ``overlap``: the layers' compressions on a worker beside the pass
    (``kvbench.overlap``); None: on CUDA, where the device then runs both at once."""
    device = engines[0].device
    shared = _SharedPass(engines, len(prompt), max_new_tokens)
    index = torch.arange(len(prompt), device=device).view(1, -1)
    plan = PassPlan(query_positions=index, num_queries=torch.tensor([len(prompt)], device=device),
                    stat_sets=shared.stat_sets, after_layer=shared.compress_layer)
    _sync(device)
    t0 = time.perf_counter()
    if overlap is None:
        overlap = device.type == "cuda"
    shared.worker = LayerWorker(shared.compress_groups, device) if overlap else None
    try:
        logits = engines[0]._forward(torch.tensor([prompt], device=device), index, index, shared.cache, plan,
                                     logits_to_keep=1)
    finally:
        worker, shared.worker = shared.worker, None
        if worker is not None:
            worker.close()
    _sync(device)
    in_pass = [timer.total("compress") for timer in shared.timers]  # each point's compression inside the pass
    for i, share in enumerate(shared.group_seconds()):  # and its share of those done together
        in_pass[i] += share
        shared.sessions[i]._seconds["compress"] += share
    # overlapped, the compressions' spans hold the next layers' kernels too: the pass keeps what is left, if any
    return shared.finish(logits, suffix, max(0.0, time.perf_counter() - t0 - sum(in_pass)), in_pass)


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
                session.set_layer_budgets(engine.budgets_before_pass(n_keep, n, max_new_tokens))
        groups: dict[str, list[int]] = {}  # points compressed together: one method and hyperparameters
        for i, engine in enumerate(engines):
            groups.setdefault(repr(engine.method), []).append(i)
        self.groups = list(groups.values())
        self.together: dict[tuple[int, ...], DeviceTimer] = {}  # the points of a call together -> its time
        self.apart: set[int] = set()  # groups whose points compress one by one (their call together raised)
        self.requests = [(engine.method.needs, engine.method.window) for engine in engines]
        self.stat_sets = tuple(dict.fromkeys(self.requests))
        self.kept_stats = [[None] * L for _ in engines]  # the deferred points' statistics, every layer's
        self.errors: list[Exception | None] = [None] * len(engines)
        self.after_pass = [0.0] * len(engines)  # a deferred point's share of its group's compression after the pass
        self.cache = CompressedCache(L)  # the pass's own: each uncompressed layer until the points took it
        self.pointers: list[set[int]] = [set() for _ in range(L)]  # storages of each uncompressed layer
        self.worker: LayerWorker | None = None  # set while the pass runs, when its compressions overlap it

    def compress_layer(self, layer: int) -> None:
        """``PassPlan.after_layer``: every point's copy of the layer compressed (or kept, for a deferred point),
        in line or handed to the worker; then the pass drops the uncompressed layer."""
        kv, stats = self.cache.kv(layer), self.cache.set_stats[layer]
        self.pointers[layer] = {t.untyped_storage().data_ptr() for t in (kv.keys, kv.values, kv.positions,
                                                                         kv.lengths)}
        if self.worker is None:
            self.compress_groups(layer, kv, stats)
        else:
            self.worker.submit(layer, kv, stats)
        self.cache.layers[layer].kv, self.cache.set_stats[layer] = None, []

    def compress_groups(self, layer: int, kv: LayerKV, stats: list[AttentionStats]) -> None:
        """Every group's points compressed from the pass's layer ``layer``: together where they can, else alone."""
        host_lengths = self.cache.layers[layer].host_lengths  # the pass's mirror: it writes a layer once
        for group in self.groups:
            live = [i for i in group if self.errors[i] is None]
            if len(live) > 1 and not self.deferred[live[0]] and id(group) not in self.apart:
                try:
                    self._compress_together(live, layer, kv, host_lengths, stats)
                    continue
                except Exception as err:  # noqa: BLE001 - one by one below: each point gets its own row or error
                    self.apart.add(id(group))
                    log.info("%s: %d points compress one by one from layer %d on (together: %r)",
                             self.engines[live[0]].method.name, len(live), layer, err)
            for i in live:
                self._compress_alone(i, layer, kv, host_lengths, stats)

    def _compress_alone(self, i: int, layer: int, kv: LayerKV, host_lengths: np.ndarray, stats: list) -> None:
        engine, session = self.engines[i], self.sessions[i]
        fork = LayerKV(keys=kv.keys, values=kv.values, positions=kv.positions, lengths=kv.lengths)
        own_stats = dataclasses.replace(stats[self.stat_sets.index(self.requests[i])])
        try:
            own_stats = engine.with_raw_keys(fork, own_stats, engine.method.needs)
            if self.deferred[i]:
                session.cache.set_kv(layer, fork, host_lengths)
                self.kept_stats[i][layer] = own_stats
            else:
                engine.compress_prompt_layer(session, layer, fork, host_lengths, own_stats, own=self.private)
        except Exception as err:  # noqa: BLE001 - one point's failure leaves the others' rows intact
            self.errors[i] = err

    def _compress_together(self, points: list[int], layer: int, kv: LayerKV, host_lengths: np.ndarray,
                           stats: list) -> None:
        """One ``compress`` call for ``points`` (one method, several budgets) after the pass's layer ``layer``."""
        engine = self.engines[points[0]]
        own_stats = engine.with_raw_keys(kv, dataclasses.replace(stats[self.stat_sets.index(self.requests[
            points[0]])]), engine.method.needs)  # raw keys once, for all rows
        self._adopt_together(points, layer, kv, host_lengths, own_stats,
                             self.together.setdefault(tuple(points), DeviceTimer(engine.device)))

    def _adopt_together(self, points: list[int], layer: int, kv: LayerKV, host_lengths: np.ndarray,
                        stats: AttentionStats, timer: DeviceTimer) -> None:
        """The layer ``kv`` (one row; its lengths on the host: ``host_lengths``) broadcast to a row per point, each
        row's budget its point's, compressed in one call; every point adopts its row (views of the call's result).
        The rows' lengths come from the host's sizes (``Method.kept_lengths``), or are read back once for all."""
        engine, k = self.engines[points[0]], len(points)
        rows = LayerKV(keys=kv.keys.expand(k, -1, -1, -1), values=kv.values.expand(k, -1, -1, -1),
                       positions=kv.positions.expand(k, -1, -1), lengths=kv.lengths.expand(k, -1))
        n_keep = torch.cat([self.sessions[i].layer_n_keep[layer] for i in points])
        host = HostSizes(n_keep=np.concatenate([self.sessions[i].host_n_keep[layer] for i in points]),
                         lengths=np.broadcast_to(host_lengths, (k, host_lengths.shape[1])))
        with timer.section("compress"):
            compressed = engine.method.compress(layer, rows, stats.broadcast(k), n_keep, "prefill", host)
            lengths = engine.method.kept_lengths(layer, host)
            if lengths is None:
                lengths = compressed.lengths.cpu().numpy()
            own = [self.private(layer, engine.method.batch_row(compressed, b, max(1, int(lengths[b].max())), host))
                   for b in range(k)]
            for b, (i, row) in enumerate(zip(points, own)):  # all or none of the points take their row
                self.sessions[i].cache.set_kv(layer, row, lengths[b:b + 1])

    def _compress_after_pass_together(self, points: list[int]) -> list[int]:
        """The deferred points of one method (``Method.budget_needs``, several budgets) after the pass: each
        point's layer budgets from the statistics its layers kept, then every layer in one call for all of
        them. A point whose budgets raise gets its error; should a call raise, the points compress the layers
        from there on one by one. Returns the points that compressed (their time: ``self.after_pass``)."""
        engine, t0 = self.engines[points[0]], time.perf_counter()
        timer = DeviceTimer(engine.device)
        for i in points:
            try:
                self.sessions[i].set_layer_budgets(engine.budgets_after_pass(self.n_keeps[i], self.kept_stats[i],
                                                                             self.max_new_tokens))
            except Exception as err:  # noqa: BLE001 - its own error; the others go on
                self.errors[i] = err
        live = [i for i in points if self.errors[i] is None]
        if len(live) < 2:  # nothing to do together: ``finish`` compresses a lone point as alone
            return []
        for layer in range(engine.num_layers):
            try:
                kept = self.sessions[live[0]].cache.layers[layer]
                self._adopt_together(live, layer, kept.kv, kept.host_lengths, self.kept_stats[live[0]][layer], timer)
                for i in live:
                    self.sessions[i].cache.pass_stats[layer] = AttentionStats()
            except Exception as err:  # noqa: BLE001 - one by one below: each point gets its own row or error
                log.info("%s: %d points compress one by one from layer %d on (together: %r)",
                         engine.method.name, len(live), layer, err)
                for i in live:
                    try:
                        engine.compress_kept_layers(self.sessions[i], self.kept_stats[i], self.private, start=layer)
                    except Exception as alone_err:  # noqa: BLE001
                        self.errors[i] = alone_err
                break
        _sync(engine.device)
        done = [i for i in live if self.errors[i] is None]
        seconds, elapsed = timer.seconds("compress"), time.perf_counter() - t0  # the timer's events: read once
        for i in done:
            self.sessions[i]._seconds["compress"] += seconds / len(live)
            self.after_pass[i] = elapsed / len(live)
        return done

    def group_seconds(self) -> list[float]:
        """Per point, its share of the calls together it took part in (inside the pass; read once)."""
        shares = [0.0] * len(self.engines)
        for points, timer in self.together.items():
            seconds = timer.seconds("compress")
            for i in points:
                shares[i] += seconds / len(points)
        return shares

    def private(self, layer: int, kv: LayerKV) -> LayerKV:
        """``kv`` with tensors of its own where it still holds the pass's layer ``layer`` (a method may return its
        input: the full cache, WeightedKV under budget)."""
        tensors = {"keys": kv.keys, "values": kv.values, "positions": kv.positions, "lengths": kv.lengths}
        shared = {name for name, t in tensors.items() if t.untyped_storage().data_ptr() in self.pointers[layer]}
        return dataclasses.replace(kv, **{name: tensors[name].clone() for name in shared}) if shared else kv

    def finish(self, logits: torch.Tensor, suffix: list[int], shared_seconds: float,
               in_pass: list[float]) -> list[Session | Exception]:
        """After the pass: the deferred points' compression, then every row finished (``Engine.finish_row``), the
        suffix fed on every row (its time shared equally), and every row timed. logits: (1, 1, V) of the prompt's
        last token. On CUDA the suffix goes through one pass for all rows (``Session.feed_together``: the weights
        read once, each row over its own cache; its GEMMs may round a row's last bits as a pass of one row does
        not, as the shared pass's attention may); should that pass raise, the error ends the group, as one in the
        prompt pass does. On a CPU (where a GEMM over more rows rounds a row's last bits too) every row's suffix
        goes through a pass of its own, its error the row's own, so that every row is the row it is alone, to the
        bit. A 40-token suffix for 34 points at 16k on an H200: the shared pass 3.10 s against 4.41 s with a pass
        per row (``scripts/profile_shared_pass.py --suffix 40``)."""
        together = set()  # deferred points compressed together, one call a layer for each method's points
        for group in self.groups:
            live = [i for i in group if self.errors[i] is None]
            if len(live) > 1 and self.deferred[live[0]]:
                together.update(self._compress_after_pass_together(live))
        rows: list[Session | Exception] = []
        own = [0.0] * len(self.engines)
        device = self.engines[0].device
        tokens = torch.tensor([suffix], device=device) if suffix else None
        together_suffix = bool(suffix) and device.type == "cuda"
        for i, (engine, session) in enumerate(zip(self.engines, self.sessions)):
            t1 = time.perf_counter()
            try:
                if self.errors[i] is not None:
                    raise self.errors[i]
                if self.deferred[i] and i not in together:
                    engine.compress_after_pass(session, self.n_keeps[i], self.kept_stats[i], self.max_new_tokens,
                                               own=self.private)
                engine.finish_row(session, self.n, logits, len(suffix), self.max_new_tokens)
                if suffix and not together_suffix:
                    session.feed(tokens, phase="extend")
            except Exception as err:  # noqa: BLE001 - as in compress_layer
                rows.append(err)
                continue
            _sync(device)
            own[i] = time.perf_counter() - t1
            rows.append(session)
        finished = [row for row in rows if isinstance(row, Session)]
        t2 = time.perf_counter()
        if together_suffix and finished:
            Session.feed_together(finished, tokens.expand(len(finished), -1), "extend")
            _sync(device)
        suffix_share = (time.perf_counter() - t2) / max(1, len(finished))
        end = clock_mark(device)
        for i, row in enumerate(rows):
            if isinstance(row, Session):
                row.prefill_seconds = shared_seconds + in_pass[i] + self.after_pass[i] + own[i] + suffix_share
                row.prefill_end = end
        return rows
