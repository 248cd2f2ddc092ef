"""The engine: runs a HF causal LM through a ``CompressedCache`` and calls the method at the right moments.

    session = engine.prefill(prompts, max_new_tokens, suffixes)  # prompt passes, compression, suffixes
    session.feed(tokens)                                         # teacher-forced / decode passes
    engine.generate(prompts, ...)                                # greedy decoding on top of the two

Prefill runs one row at a time, so no pass ever carries padding and a batch gives exactly the outputs of its
rows alone (a row repeated in the batch, as the throughput benchmark's copies of one prompt, is prefilled once
and copied). A row's prompt runs in one pass (or in ``prefill_chunk_size`` chunks); a method whose layer
budgets need no statistics compresses each layer right after that layer's attention (inside the forward),
so the uncompressed prompt cache of a layer is freed before the next layer runs; a method whose budgets
depend on every layer's statistics (``Method.budget_needs``, D2O) compresses after the pass. The suffix (the
question in query-agnostic mode) follows, uncompressed. The rows' caches are then copied into the batch's
static-capacity storage (budget plus the slots decoding adds before the next compression).

Decode steps make every shape decision on the host (``CompressedLayer.host_lengths``); methods that evict
one slot per step (``Method.evict_one``) do it in place, so a step is a fixed sequence of kernels that never
waits for the device (``engine.cuda_graphs`` replays it as one CUDA graph, ``kvbench.graphs``). Everything
else (multi-token passes, decode intervals > 1, rows over budget by more than one slot) runs the method's
``compress`` on the row-ordered cache, the reference path (``decode_path="compress"`` forces it).
"""

from __future__ import annotations

import resource
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
from torch import Tensor

from kvbench.attention import attach, rotate_keys, unrotate_keys
from kvbench.budget import Budget
from kvbench.cache import CompressedCache, PassPlan
from kvbench.errors import ConfigError
from kvbench.graphs import DecodeGraph
from kvbench.kv import AttentionStats, LayerKV
from kvbench.memory import PeakMemory
from kvbench.methods.base import Method

POSITION_MODES = ("original", "cache_length")
DECODE_PATHS = ("in_place", "compress")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Process-wide peak so far. CUDA: max allocated since the last reset; CPU: peak RSS (ru_maxrss, KiB)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class DeviceTimer:
    """Seconds spent in named sections, without synchronising inside them: CUDA sections are bracketed by
    events read once in ``seconds`` (after the work is done), CPU sections by the host clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.events: dict[str, list] = defaultdict(list)
        self.host: dict[str, float] = defaultdict(float)

    @contextmanager
    def section(self, name: str):
        if self.cuda and torch.cuda.is_current_stream_capturing():  # a captured step is timed as a whole
            yield
        elif self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events[name].append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.host[name] += time.perf_counter() - t0

    def total(self, name: str) -> float:
        """Seconds in ``name`` so far, leaving them to be read again (``seconds`` takes them)."""
        pairs = self.events.get(name, [])
        if pairs:
            pairs[-1][1].synchronize()
        return self.host.get(name, 0.0) + sum(s.elapsed_time(e) for s, e in pairs) / 1000

    def seconds(self, name: str) -> float:
        pairs = self.events.pop(name, [])
        if pairs:
            pairs[-1][1].synchronize()
        return self.host.pop(name, 0.0) + sum(s.elapsed_time(e) for s, e in pairs) / 1000


@dataclass
class Generation:
    """One sample's output and its measurements."""

    tokens: list[int]
    prompt_length: int
    kept_per_layer_head: list[list[int]]  # realized slots after prefill compression, [layer][head]
    n_keep: int  # requested slots per head after prefill (mean over layers if layer-adaptive)
    kv_bytes_full: int  # K+V bytes of the uncompressed prompt cache
    kv_bytes_compressed: int  # after prefill compression
    kv_bytes_final: int  # at the end of generation
    decode_kv_bytes_mean: float  # K+V bytes of the real slots attention read per decode step (mean over steps)
    prefill_seconds: float  # time to first token: prompt pass + prefill compression + suffix
    compress_seconds: float  # prefill compression alone (inside prefill_seconds)
    decode_seconds: float  # all decode steps, decode-time compression included
    decode_compress_seconds: float  # decode-time compression alone (inside decode_seconds)
    tpot_seconds: float  # decode time per generated token (one batched decode step)
    peak_memory_bytes: int  # during this call: CUDA max allocated; CPU peak RSS growth (kvbench.memory)
    peak_memory_above_weights_bytes: int  # the peak minus the model's parameters (CPU growth excludes them)
    stopped_by: str  # "eos", "stop_string", "max_new_tokens"


@dataclass
class Session:
    """A batch's state in the compressed cache between passes.

    layer_n_keep / host_n_keep: (L, B) budgets on the device and on the host; next_index: (B,) original index
    of each row's next token; prefill_lengths: (L, B, H) realized slots right after prefill compression."""

    engine: "Engine"
    cache: CompressedCache
    next_index: Tensor
    layer_n_keep: Tensor
    host_n_keep: np.ndarray
    logits: Tensor | None = None  # (B, V) logits of the last token of the last pass
    decode_steps: int = 0
    prefill_lengths: Tensor | None = None
    kv_bytes_full: list[int] = field(default_factory=list)  # per row
    kv_bytes_compressed: list[int] = field(default_factory=list)  # per row, after prefill compression
    timer: DeviceTimer | None = None
    _seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @property
    def compress_seconds(self) -> float:
        """Prefill compression so far (reading it waits for the timed device work)."""
        self._seconds["compress"] += self.timer.seconds("compress")
        return self._seconds["compress"]

    @property
    def decode_compress_seconds(self) -> float:
        """Decode-time observation and compression so far."""
        self._seconds["decode_compress"] += self.timer.seconds("decode_compress")
        return self._seconds["decode_compress"]

    def feed(self, tokens: Tensor, phase: str = "decode", static_shapes: bool = False) -> Tensor:
        """Run ``tokens`` (B, q) through the model on top of the cache; returns logits (B, q, V).

        phase="decode": the method's decode-time compression runs after the pass (if enabled and due);
        phase="extend": no compression (e.g. the question appended after a compressed context).
        Methods that compress while decoding observe the attention of every pass, extend passes included,
        so that tokens fed in a chunk accumulate scores like decoded ones. ``static_shapes``: no kernel is
        shaped by a host-known length (the step is being captured as a CUDA graph, ``kvbench.graphs``).
        """
        if phase not in ("decode", "extend"):
            raise ConfigError(f"unknown feed phase '{phase}'; accepted: decode, extend")
        engine, method = self.engine, self.engine.method
        B, q = tokens.shape
        index = self.next_index.view(B, 1) + torch.arange(q, device=tokens.device)
        observing = method.compress_during_decode
        plan = PassPlan(query_positions=index, num_queries=torch.full((B,), q, device=tokens.device),
                        wanted=method.needed_stats("decode") if observing else frozenset(), window=method.window,
                        static_shapes=static_shapes, expand=engine.expand)
        logits = engine._forward(tokens, index, engine._rope_positions(self.cache, index), self.cache, plan)
        self.next_index += q  # in place: a captured decode step keeps reading the same tensor
        self.logits = logits[:, -1]
        if observing:
            self.decode_steps += phase == "decode"
            with self.timer.section("decode_compress"):
                self._observe_and_compress(compress=phase == "decode", q=q)
        return logits

    def _observe_and_compress(self, compress: bool, q: int) -> None:
        engine, cache, method = self.engine, self.cache, self.engine.method
        due = compress and self.decode_steps % method.decode_interval == 0
        in_place = engine.in_place_eviction(q)
        with torch.inference_mode():  # the state tensors were made in inference mode; keep methods there
            for index, layer in enumerate(cache.layers):
                stats = engine.with_raw_keys(layer.kv, cache.pass_stats[index], method.decode_needs)
                method.observe(index, layer.kv, stats)
                if not due:
                    continue
                excess = layer.host_lengths - self.host_n_keep[index][:, None]  # (B, H)
                if not (excess > 0).any():
                    continue
                if in_place and (excess == 1).all():
                    method.evict_one(index, layer.kv, stats, self.layer_n_keep[index])
                    layer.removed_one()
                else:
                    kv, stats = engine._ordered(layer, stats)
                    layer.store(method.compress(index, kv, stats, self.layer_n_keep[index], "decode"))


class Engine:
    """model + method + budget. ``attn_implementation`` is the wrapped implementation (eager/sdpa/flash).

    prefill_chunk_size: run each prompt in chunks of this many tokens with compression between chunks (peak
    memory follows the budget instead of the prompt); None = one pass. [I] With chunks, the method compresses
    after every chunk, seeing for every cached slot its attention summed over all prompt queries so far
    (``column_sums``) and the chunk's own last ``window`` queries (``window_column_sums``).
    cuda_graphs: replay decode steps as CUDA graphs (``kvbench.graphs``).
    decode_path: "in_place" (one slot evicted in place per step where the method can) or "compress" (the
    method's functional ``compress`` every time: the reference the in-place path is tested against).
    """

    def __init__(
        self,
        model,
        method: Method,
        budget: Budget,
        attn_implementation: str = "sdpa",
        position_mode: str = "original",
        prefill_chunk_size: int | None = None,
        cuda_graphs: bool = False,
        decode_path: str = "in_place",
    ) -> None:
        if position_mode not in POSITION_MODES:
            raise ConfigError(f"unknown position_mode '{position_mode}'; accepted: {', '.join(POSITION_MODES)}")
        if decode_path not in DECODE_PATHS:
            raise ConfigError(f"unknown decode_path '{decode_path}'; accepted: {', '.join(DECODE_PATHS)}")
        if prefill_chunk_size is not None and (isinstance(prefill_chunk_size, bool) or
                                               not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1):
            raise ConfigError(f"engine.prefill_chunk_size={prefill_chunk_size!r}; accepted: an integer >= 1 or null")
        if prefill_chunk_size is not None and method.budget_needs:
            # [I] their layer budgets are defined on every prompt query's attention to every prompt token
            raise ConfigError(f"engine.prefill_chunk_size={prefill_chunk_size} with method={method.name}: its layer "
                              f"budgets need {', '.join(sorted(method.budget_needs))} of the whole prompt before any "
                              "compression; accepted: engine.prefill_chunk_size=null")
        self.model = model
        self.method = method
        self.budget = budget
        self.attn_implementation = attn_implementation
        self.position_mode = position_mode
        self.prefill_chunk_size = prefill_chunk_size
        self.decode_path = decode_path
        self.num_layers = model.config.num_hidden_layers
        self.device = next(model.parameters()).device
        if cuda_graphs and self.device.type != "cuda":
            raise ConfigError(f"engine.cuda_graphs=true needs a CUDA model; this one is on {self.device}")
        self.cuda_graphs = cuda_graphs
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # what a pass's attention reads instead of a method's stored slots (PassPlan.expand)
        self.expand = partial(method.expand, rotate=partial(rotate_keys, model)) if method.expands_slots else None

    def with_method(self, method: Method, budget: Budget) -> "Engine":
        """The same model and engine settings with another method and budget (reference systems)."""
        return Engine(self.model, method, budget, self.attn_implementation, self.position_mode,
                      self.prefill_chunk_size, self.cuda_graphs, self.decode_path)

    def in_place_eviction(self, q: int) -> bool:
        """Whether a pass of q tokens compresses through ``Method.evict_one`` (rows over budget by one)."""
        method = self.method
        return self.decode_path == "in_place" and method.evicts_in_place and q == 1 and method.decode_interval == 1

    # -- passes ---------------------------------------------------------------------------------------

    def _rope_positions(self, cache: CompressedCache, index: Tensor) -> Tensor:
        """RoPE positions of new tokens: their original index, or (pos-shift style) the row's cache length."""
        if self.position_mode == "original" or cache.layers[0].kv is None:
            return index
        start = cache.lengths().amax(dim=(0, 2))  # (B,) from the host mirror
        return start.to(index.device, non_blocking=True).view(-1, 1) + torch.arange(index.shape[1],
                                                                                     device=index.device)

    def _forward(self, tokens: Tensor, index: Tensor, rope_positions: Tensor, cache: CompressedCache,
                 plan: PassPlan, logits_to_keep: int = 0) -> Tensor:
        cache.plan = plan
        with torch.inference_mode(), attach(self.model, self.attn_implementation):
            out = self.model(input_ids=tokens, position_ids=rope_positions, past_key_values=cache, use_cache=True,
                             kvbench_cache=cache, logits_to_keep=logits_to_keep)
        return out.logits

    def with_raw_keys(self, kv: LayerKV, stats: AttentionStats, needs: frozenset[str]) -> AttentionStats:
        if "raw_keys" in needs:
            stats.raw_keys = unrotate_keys(self.model, kv.keys, kv.positions)
        return stats

    @staticmethod
    def _ordered(layer, stats: AttentionStats) -> tuple[LayerKV, AttentionStats]:
        """The layer's cache in original-token order with padding cleared, and the statistics moved with it,
        as ``Method.compress`` expects (in-place removals leave slots unordered and padding stale)."""
        kv = layer.kv
        if layer.ordered:
            kv.zero_padding()
            return kv, stats
        order = kv.position_order()
        moved = stats.aligned(kv.capacity, order)
        moved.raw_keys = None if stats.raw_keys is None else stats.raw_keys.gather(
            2, order.unsqueeze(-1).expand_as(stats.raw_keys))
        return kv.gather(order, kv.lengths), moved

    # -- prefill --------------------------------------------------------------------------------------

    def prefill(self, prompts: list[list[int]], max_new_tokens: int,
                suffixes: list[list[int]] | None = None) -> Session:
        """Each row: prompt pass(es) with compression, then its suffix (uncompressed); then the batch's storage.

        ``suffixes`` (e.g. the question in query-agnostic mode) are fed after the row's prefill compression."""
        if any(len(p) == 0 for p in prompts):
            raise ConfigError("empty prompt: every sample needs at least one token")
        lengths = torch.tensor([len(p) for p in prompts])
        n_keep = self.budget.n_keep(lengths, max_new_tokens, self.method.budget_basis)
        timer = DeviceTimer(self.device)
        rows, prefilled = [], {}  # a row repeated in the batch is prefilled once: its outputs are the same
        for b, prompt in enumerate(prompts):
            suffix = suffixes[b] if suffixes is not None else []
            key = (tuple(prompt), tuple(suffix))
            if key not in prefilled:
                prefilled[key] = self._prefill_row(prompt, n_keep[b:b + 1], max_new_tokens, suffix, timer)
            rows.append(prefilled[key])
        return self.join(rows, timer)

    def join(self, rows: list[Session], timer: DeviceTimer) -> Session:
        """Prefilled single-row sessions as one batch session (a row repeated in ``rows`` is copied)."""
        session = rows[0] if len(rows) == 1 else self._batch(rows)
        session.timer = timer
        return session

    def _prefill_row(self, prompt: list[int], n_keep: Tensor, max_new_tokens: int, suffix: list[int],
                     timer: DeviceTimer) -> Session:
        method, L, n = self.method, self.num_layers, len(prompt)
        session = self.new_row(n, timer)
        cache = session.cache
        tokens = torch.tensor([prompt], device=self.device)
        per_layer = not method.budget_needs
        if per_layer:  # budgets from the prompt length alone: known before the pass
            session.layer_n_keep = self.budgets_before_pass(n_keep, n, max_new_tokens)
        chunk = self.prefill_chunk_size or n
        observed = [None] * L  # chunked: column sums of every slot over all prompt queries so far, by position
        logits = None
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            index = torch.arange(start, stop, device=self.device).view(1, -1)

            def compress_layer(layer: int) -> None:
                stats = self._prompt_stats(cache, layer, observed, stop, start > 0)
                self.compress_prompt_layer(session, layer, cache.kv(layer), stats)
                cache.pass_stats[layer] = AttentionStats()  # drop the prompt statistics once used

            plan = PassPlan(query_positions=index, num_queries=torch.tensor([stop - start], device=self.device),
                            wanted=method.needs, window=method.window,
                            after_layer=compress_layer if per_layer else None, expand=self.expand)
            logits = self._forward(tokens[:, start:stop], index, index, cache, plan, logits_to_keep=1)
            if not per_layer:
                stats = [self._prompt_stats(cache, layer, observed, stop, start > 0) for layer in range(L)]
                self.compress_after_pass(session, n_keep, stats, max_new_tokens)
        return self.finish_row(session, n, logits, suffix, max_new_tokens)

    def new_row(self, prompt_length: int, timer: DeviceTimer) -> Session:
        """An empty single-row session whose prompt of ``prompt_length`` tokens is about to be prefilled."""
        return Session(self, CompressedCache(self.num_layers),
                       next_index=torch.tensor([prompt_length], device=self.device), layer_n_keep=None,
                       host_n_keep=None, timer=timer)

    def budgets_before_pass(self, n_keep: Tensor, prompt_length: int, max_new_tokens: int) -> Tensor:
        """(L, 1) layer budgets of a method whose budgets need no statistics (known from the length alone)."""
        stats = [AttentionStats(num_queries=torch.tensor([prompt_length]))] * self.num_layers
        return self.method.layer_budgets(n_keep, self.num_layers, stats, max_new_tokens).to(self.device)

    def compress_prompt_layer(self, session: Session, layer: int, kv: LayerKV, stats: AttentionStats,
                              own: Callable[[LayerKV], LayerKV] | None = None) -> None:
        """Compress a prompt layer ``kv`` into the row's cache (timed as prefill compression). ``own`` makes the
        result the row's own storage where the method returned shared tensors (a prompt pass of several rows)."""
        with session.timer.section("compress"):
            compressed = self.method.compress(layer, kv, stats, session.layer_n_keep[layer], "prefill")
            session.cache.set_kv(layer, compressed if own is None else own(compressed))

    def compress_after_pass(self, session: Session, n_keep: Tensor, stats: list[AttentionStats],
                            max_new_tokens: int, own: Callable[[LayerKV], LayerKV] | None = None) -> None:
        """A method whose layer budgets need every layer's statistics (``Method.budget_needs``): the budgets,
        then every layer compressed, after the prompt pass."""
        session.layer_n_keep = self.method.layer_budgets(n_keep, self.num_layers, stats, max_new_tokens).to(self.device)
        for layer in range(self.num_layers):
            self.compress_prompt_layer(session, layer, session.cache.kv(layer), stats[layer], own)
            session.cache.pass_stats[layer] = AttentionStats()

    def finish_row(self, session: Session, prompt_length: int, logits: Tensor, suffix: list[int],
                   max_new_tokens: int) -> Session:
        """After the prompt pass and its compression: the row's records, its storage planned for what
        follows, then its ``suffix`` fed uncompressed. logits: (1, q, V) of the pass."""
        cache = session.cache
        session.host_n_keep = session.layer_n_keep.cpu().numpy()
        session.logits = logits[:, -1]
        session.prefill_lengths = cache.lengths()
        session.kv_bytes_full = [prompt_length * self._token_bytes(cache)]
        session.kv_bytes_compressed = [self.row_bytes(cache, 0)]
        self._plan_capacity(session, extra=len(suffix), max_new_tokens=max_new_tokens)
        if suffix:
            session.feed(torch.tensor([suffix], device=self.device), phase="extend")
        return session

    def _prompt_stats(self, cache: CompressedCache, layer: int, observed: list, seen: int,
                      chunked: bool) -> AttentionStats:
        """The statistics ``compress`` gets after a prompt pass; with chunks, column sums accumulate over all
        prompt queries so far (by slot position, so they follow the slots the method kept)."""
        stats, kv = cache.pass_stats[layer], cache.kv(layer)
        if stats.column_sums is not None and self.prefill_chunk_size is not None:
            if observed[layer] is None:
                observed[layer] = stats.column_sums.new_zeros(*stats.column_sums.shape[:2], seen)
            table = observed[layer]
            if table.shape[-1] < seen:
                table = observed[layer] = torch.nn.functional.pad(table, (0, seen - table.shape[-1]))
            valid = kv.valid()
            position = torch.where(valid, kv.positions, 0)
            table.scatter_add_(2, position, torch.where(valid, stats.column_sums, 0.0))
            stats.column_sums = torch.where(valid, table.gather(2, position), 0.0)
        if chunked:
            stats.num_queries = torch.full_like(stats.num_queries, seen)
        return self.with_raw_keys(kv, stats, self.method.needs)

    def _plan_capacity(self, session: Session, extra: int, max_new_tokens: int) -> None:
        """Re-allocate every layer once for what comes next: ``extra`` suffix tokens, then decoding up to the
        next compression (budget + decode_interval) or, for prompt-only methods, every new token."""
        method = self.method
        for index, layer in enumerate(session.cache.layers):
            length = layer.longest + extra
            if method.compress_during_decode:
                keep = int(session.host_n_keep[index].max())
                capacity = min(length + max_new_tokens, max(keep, length) + method.decode_interval)
            else:
                capacity = length + max_new_tokens
            if capacity != layer.kv.capacity:
                layer.kv.resize(max(capacity, layer.longest))
            layer.kv.pack_state()

    def _batch(self, rows: list[Session]) -> Session:
        """Copy the rows' caches into one batch storage per layer (capacity: the largest row's plan)."""
        cache = CompressedCache(self.num_layers)
        for index, layer in enumerate(cache.layers):
            parts = [row.cache.layers[index] for row in rows]
            capacity = max(part.kv.capacity for part in parts)
            first = parts[0].kv
            B, H = len(rows), first.lengths.shape[1]
            kv = LayerKV(
                keys=first.keys.new_zeros(B, H, capacity, first.keys.shape[-1]),
                values=first.values.new_zeros(B, H, capacity, first.values.shape[-1]),
                positions=first.positions.new_full((B, H, capacity), -1),
                lengths=torch.cat([part.kv.lengths for part in parts]),
                state={name: s.new_zeros(B, H, capacity) for name, s in first.state.items()},
                tables={name: self._stacked_table([part.kv.tables[name] for part in parts]) for name in first.tables},
            )
            for b, part in enumerate(parts):
                t = part.kv.capacity
                kv.keys[b, :, :t] = part.kv.keys[0]
                kv.values[b, :, :t] = part.kv.values[0]
                kv.positions[b, :, :t] = part.kv.positions[0]
                for name, s in part.kv.state.items():
                    kv.state[name][b, :, :t] = s[0]
            for part in parts:
                part.kv = None  # free the rows' copies before the next layer is copied
            kv.pack_state()
            layer.adopt(kv, np.concatenate([part.host_lengths for part in parts]))
            layer.ordered = all(part.ordered for part in parts)
            layer.fresh = False
        return Session(
            self, cache, next_index=torch.cat([row.next_index for row in rows]),
            layer_n_keep=torch.cat([row.layer_n_keep for row in rows], dim=1),
            host_n_keep=np.concatenate([row.host_n_keep for row in rows], axis=1),
            logits=torch.cat([row.logits for row in rows]), decode_steps=0,
            prefill_lengths=torch.cat([row.prefill_lengths for row in rows], dim=1),
            kv_bytes_full=[b for row in rows for b in row.kv_bytes_full],
            kv_bytes_compressed=[b for row in rows for b in row.kv_bytes_compressed],
        )

    @staticmethod
    def _stacked_table(rows: list[Tensor]) -> Tensor:
        """The rows' (1, H, E_row) tables as one batch table, each padded with unused entries (-1) to the largest."""
        size = max(t.shape[-1] for t in rows)
        return torch.cat([torch.nn.functional.pad(t, (0, size - t.shape[-1]), value=-1) for t in rows])

    @staticmethod
    def _token_bytes(cache: CompressedCache) -> int:
        """K+V bytes one token occupies in every head of every layer."""
        return sum(layer.kv.lengths.shape[1] * layer.kv.slot_bytes for layer in cache.layers)

    @staticmethod
    def row_bytes(cache: CompressedCache, b: int) -> int:
        """K+V bytes of row b's real slots (host mirror)."""
        return int(cache.row_bytes()[b])

    # -- greedy generation ------------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        stop_token_ids: set[int],
        suffixes: list[list[int]] | None = None,
        min_new_tokens: int = 0,
        stop_when: Callable[[list[int]], bool] | None = None,
    ) -> list[Generation]:
        """Greedy decoding. ``suffixes`` (e.g. the question in query-agnostic mode) are fed after the prefill
        compression and never compressed at prefill; ``stop_token_ids`` end a row (not included in its output);
        ``stop_when(tokens)`` ends a row once it returns True for the row's output so far (stop strings)."""
        with PeakMemory(self.device) as peak, attach(self.model, self.attn_implementation):
            _sync(self.device)
            t0 = time.perf_counter()
            session = self.prefill(prompts, max_new_tokens, suffixes)
            _sync(self.device)
            gens = self.decode(session, [len(p) for p in prompts], time.perf_counter() - t0, max_new_tokens,
                               stop_token_ids, min_new_tokens, stop_when)
        self.record_peak(gens, peak.bytes)
        return gens

    def record_peak(self, gens: list[Generation], peak: int) -> None:
        """Set the peak memory (``PeakMemory.bytes``) of the block that made ``gens`` on each of them."""
        above = peak - self.weight_bytes if self.device.type == "cuda" else peak
        for gen in gens:
            gen.peak_memory_bytes, gen.peak_memory_above_weights_bytes = peak, above

    def decode(self, session: Session, prompt_lengths: list[int], prefill_seconds: float, max_new_tokens: int,
               stop_token_ids: set[int], min_new_tokens: int = 0,
               stop_when: Callable[[list[int]], bool] | None = None) -> list[Generation]:
        """Greedy decoding of a prefilled batch ``session`` (``prefill`` or ``join``); ``prefill_seconds``: the
        time its prefill took (the batch's, shared out over its rows). Peak memory is left 0 for the caller's
        measurement (``record_peak``)."""
        B = len(prompt_lengths)
        compress_seconds = session.compress_seconds
        outputs: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        stopped = ["max_new_tokens"] * B
        stop = torch.tensor(sorted(stop_token_ids), dtype=torch.long, device=self.device)
        kv_read, token_bytes = np.zeros(B), self._token_bytes(session.cache)
        graph = DecodeGraph(session) if self.cuda_graphs else None
        t1 = time.perf_counter()
        steps = 0
        for step in range(max_new_tokens):
            logits = session.logits
            if step < min_new_tokens and stop.numel():  # out of place: the logits are an inference tensor
                logits = logits.index_fill(1, stop, -float("inf"))
            next_tokens = logits.argmax(-1)
            for b, token in enumerate(next_tokens.tolist()):
                if done[b]:
                    continue
                if token in stop_token_ids:
                    done[b], stopped[b] = True, "eos"
                else:
                    outputs[b].append(token)
                    if stop_when is not None and stop_when(outputs[b]):
                        done[b], stopped[b] = True, "stop_string"
            if all(done) or step == max_new_tokens - 1:
                break
            kv_read += session.cache.row_bytes() + token_bytes  # what this step's attention reads: cache + new token
            if graph is None:
                session.feed(next_tokens.view(B, 1), phase="decode")
            else:
                graph.step(next_tokens)
            steps += 1
        _sync(self.device)
        decode_seconds = time.perf_counter() - t1
        return [
            Generation(
                tokens=outputs[b],
                prompt_length=prompt_lengths[b],
                kept_per_layer_head=session.prefill_lengths[:, b].tolist(),
                n_keep=int(round(float(session.host_n_keep[:, b].mean()))),
                kv_bytes_full=session.kv_bytes_full[b],
                kv_bytes_compressed=session.kv_bytes_compressed[b],
                kv_bytes_final=self.row_bytes(session.cache, b),
                decode_kv_bytes_mean=float(kv_read[b] / steps) if steps else float("nan"),
                prefill_seconds=prefill_seconds / B,
                compress_seconds=compress_seconds / B,
                decode_seconds=decode_seconds / B,
                decode_compress_seconds=session.decode_compress_seconds / B,
                tpot_seconds=decode_seconds / max(1, steps),
                peak_memory_bytes=0,
                peak_memory_above_weights_bytes=0,
                stopped_by=stopped[b],
            )
            for b in range(B)
        ]
