"""The engine: runs a HF causal LM through a ``CompressedCache`` and calls the method at the right moments.

    session = engine.prefill(prompts, max_new_tokens, suffixes)  # prompt passes, compression, suffixes
    session.feed(tokens)                                         # teacher-forced / decode passes
    row = engine.prefill_row(prompt, max_new_tokens, suffix)     # one prefilled row, for a DecodeBatch
    engine.generate(prompts, ...)                                # greedy decoding (kvbench.decode)

Prefill runs one row at a time, so no pass ever carries padding and a batch gives exactly the outputs of its
rows alone (a row repeated in the batch, as the throughput benchmark's copies of one prompt, is prefilled once
and copied). A row's prompt runs in one pass (or in ``prefill_chunk_size`` chunks); a method whose layer
budgets need no statistics compresses each layer right after that layer's attention (inside the forward),
so the uncompressed prompt cache of a layer is freed before the next layer runs; a method whose budgets
depend on every layer's statistics (``Method.budget_needs``, D2O) compresses after the pass. The suffix (the
question in query-agnostic mode) follows, uncompressed. The rows' caches are then copied into the batch's
static-capacity storage (budget plus the slots decoding adds before the next compression), or, for
``generate``, into the slots of a ``kvbench.decode.DecodeBatch`` as earlier rows finish.

Decode steps make every shape decision on the host (``CompressedLayer.host_lengths``); methods that evict
one slot per step (``Method.evict_one``) do it in place, so a step is a fixed sequence of kernels that never
waits for the device (``engine.cuda_graphs`` replays it as one CUDA graph, ``kvbench.graphs``). On a GPU, each
layer's observation and in-place eviction, independent of the other layers, forks to one of ``LAYER_STREAMS`` side
streams right after the layer's attention, overlapping the rest of the pass, and the streams join the step's
stream before it ends (``LayerLanes``): the same kernels on the same tensors.
Everything else (multi-token passes, decode intervals > 1, rows over budget by more than one slot) runs the method's
``compress`` on the row-ordered cache, the reference path (``decode_path="compress"`` forces it); when only
some rows are over budget (rows that joined at different times), on those rows alone. Decode intervals count
per row from the step it joined.
"""

from __future__ import annotations

import resource
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache, partial

import numpy as np
import torch
from torch import Tensor

from kvbench.attention import Rope, attach, rotate_keys, unrotate_keys
from kvbench.budget import Budget
from kvbench.cache import CompositeCache, CompressedCache, CompressedLayer, PassPlan, row_index
from kvbench.compile import compile_enabled, compiled_decode, compiled_function, prepare_compiled_calls
from kvbench.errors import ConfigError
from kvbench.hf_compat import cache_keyword
from kvbench.kv import AttentionStats, HostSizes, LayerKV, host_to_device
from kvbench.memory import PeakMemory
from kvbench.methods.base import Method

POSITION_MODES = ("original", "cache_length")
DECODE_PATHS = ("in_place", "compress")
DATA_DRIVEN_HEADROOM = 0.25  # a decode batch's room for later rows, at points whose layer sizes the data decides
# ``Session.position_limit`` is a multiple of this: a decode step's bound changes (and a captured step is captured
# again) once every 4,096 tokens; EMS's position map (``lut_expand.centre_slots``) is then at most 4,095 entries
# a row wider than the positions need.
POSITION_LIMIT_STEP = 4096
# CUDA streams a decode step's per-layer observation and in-place eviction spread over (layer l on stream
# l % LAYER_STREAMS; 1: in line, after the pass). The layers' evictions touch only their own storage, and each is a
# few latency-bound launches of a few microseconds, so run one after another they leave most of the device idle.
# Replayed 64k steps at batch 1 (H200): CaM -9.6 %, D2O -8.5 %, WeightedKV -8 %, TOVA -5.6 %, H2O -4.5 % with
# 32 streams; CaM's 16k step of 3 points x 2 rows -20 %. Two streams replay as fast as 32 (an H200 at 32k, one
# process, interleaved: D2O's steps after the first 5.66 against 5.65 ms, CaM's 5.58 against 5.57; one stream:
# 6.31 and 6.26), and a capture that forks to fewer streams records faster (each stream allocates from segments of
# its own in the graph's private pool: 43 new segments with 32 streams, 11 with one): D2O's first step, its
# recording on an idle device, took 28-36 ms against 35-88 with 32 (results/gpu/2026-11-30, calls 3 and 4).
LAYER_STREAMS = 2


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock_mark(device: torch.device) -> float | torch.cuda.Event:
    """A point on ``device``'s clock: on CUDA an event recorded on the current stream now (it is reached when the
    device has run the work queued before it), elsewhere the host clock (every operation has finished)."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


@cache
def _side_streams(device: torch.device, count: int) -> tuple[torch.cuda.Stream, ...]:
    return tuple(torch.cuda.Stream(device) for _ in range(count))


class LayerLanes:
    """A decode pass's per-layer work on side streams: ``with lanes.fork(index)`` runs layer ``index``'s work on
    side stream ``index % count``, after everything the current stream holds when it is called (inside the pass:
    the layer's attention), and ``join`` makes the current stream wait for every lane forked since the last join,
    so the pass and its lanes are one step of the current stream's order (inside a CUDA graph's capture too: the
    side streams fork from the captured stream and join it). In line on a CPU or with count 1 (``spread`` False).
    Memory that lane work allocates is its own stream's; what it reads from the current stream's work must stay
    alive until the join (the layer's storage and its ``pass_stats``, replaced only by the next pass)."""

    def __init__(self, device: torch.device, count: int) -> None:
        self.spread = device.type == "cuda" and count > 1
        self.count = count
        self.current = torch.cuda.current_stream(device) if self.spread else None
        self.lanes = _side_streams(device, count) if self.spread else ()
        self.forked: set[int] = set()

    @contextmanager
    def fork(self, index: int):
        if not self.spread:
            yield
            return
        lane = index % self.count
        self.lanes[lane].wait_stream(self.current)
        self.forked.add(lane)
        with torch.cuda.stream(self.lanes[lane]):
            yield

    def join(self) -> None:
        for lane in sorted(self.forked):
            self.current.wait_stream(self.lanes[lane])
        self.forked.clear()


class BudgetStatistics:
    """``Method.budget_statistic`` of every layer of a prompt pass (a method with ``Method.budget_needs``), taken
    right after each layer's attention (``PassPlan.after_layer``) and copied to pinned host memory behind the last
    layer's: ``budget_stats`` waits for that copy, not for the whole pass, so the host sets the layer budgets and
    queues the compressions while the device still runs the last layer's MLP and the logits. D2O at 32k on an
    H200 (A/B, one machine): TTFT 1.918 -> 1.878 s; TPOT -0.4 % only, since the host's queueing of the 32
    compressions outlasts their device time, so the decode graph's recording still starts on an idle device.
    A layer's ``budget_needs`` statistics are dropped once the statistic is taken (D2O: the per-query-head column
    sums, (B, H_q, T) float32 a layer, held until the pass's end before)."""

    def __init__(self, method: Method, cache: CompressedCache, num_layers: int) -> None:
        self.method, self.cache = method, cache
        self.taken: list[Tensor | None] = [None] * num_layers
        self.host: Tensor | None = None
        self.copied: torch.cuda.Event | None = None

    def take(self, layer: int) -> None:
        stats = self.cache.pass_stats[layer]
        self.taken[layer] = self.method.budget_statistic(stats)
        if self.taken[layer] is None:
            return
        for name in self.method.budget_needs:  # read by the budgets alone (``Method.budget_needs``): taken now
            setattr(stats, name, None)
        if layer == len(self.taken) - 1 and all(t is not None for t in self.taken):
            stacked = torch.stack(self.taken)
            self.host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=stacked.is_cuda)
            self.host.copy_(stacked, non_blocking=True)
            if stacked.is_cuda:
                self.copied = torch.cuda.Event()
                self.copied.record(torch.cuda.current_stream(stacked.device))  # the copy's stream, on its device

    def budget_stats(self, prompt_lengths: Tensor) -> list[AttentionStats] | None:
        """What ``Method.layer_budgets`` reads, on the host (``prompt_lengths``: (B,) host), once the copy is done;
        None where the method took no statistic (it reads the pass's statistics themselves)."""
        if self.host is None:
            return None
        if self.copied is not None:
            self.copied.synchronize()
        return [AttentionStats(num_queries=prompt_lengths, budget_statistic=taken) for taken in self.host]


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
        """Seconds in ``name`` so far, taken: the next read counts from zero."""
        total = self.total(name)
        self.events.pop(name, None)
        self.host.pop(name, None)
        return total


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
    peak_memory_bytes: int  # during this call: bytes of live tensors at their peak, weights included (kvbench.memory)
    peak_memory_above_weights_bytes: int  # the peak minus the model's parameters
    stopped_by: str  # "eos", "stop_string", "max_new_tokens"
    batch_size: int = 1  # rows the decode batch it ran in holds (its slots)
    # the row's first decode step (where a new decode batch records its CUDA graph or warms it up), and the
    # mean of the steps after it; NaN where there were not enough steps or no decode batch ran the row
    first_step_seconds: float = float("nan")
    tpot_after_first_seconds: float = float("nan")


@dataclass
class Session:
    """A batch's state in the compressed cache between passes; with one row, a prefilled row (``Engine.prefill_row``)
    that a ``DecodeBatch`` places into a slot of its storage (``place``).

    layer_n_keep / host_n_keep: (L, B) budgets on the device and on the host; next_index / host_next_index: (B,)
    original index of each row's next token, on the device and on the host; prefill_lengths: (L, B, H) realized
    slots right after prefill compression (host);
    row_steps: (B,) decode passes of each row since it was placed (decode intervals count per row)."""

    engine: "Engine"
    cache: CompressedCache
    next_index: Tensor
    layer_n_keep: Tensor
    host_n_keep: np.ndarray
    host_next_index: np.ndarray
    logits: Tensor | None = None  # (B, V) logits of the last token of the last pass
    decode_steps: int = 0
    prefill_lengths: Tensor | None = None
    kv_bytes_full: list[int] = field(default_factory=list)  # per row
    kv_bytes_compressed: list[int] = field(default_factory=list)  # per row, after prefill compression
    prompt_lengths: list[int] = field(default_factory=list)  # per row, without its suffix
    # a prefilled row's time (``prefill_seconds``): seconds, or the CUDA events around work not waited for yet
    _prefill: float | tuple[torch.cuda.Event, torch.cuda.Event] = field(default=0.0, repr=False)
    # a prefilled row: where its prefill ended (its first token) on the device's clock (``clock_mark``); a decode
    # batch times the row's first step from there, placing the row and recording the step's graph included
    prefill_end: float | torch.cuda.Event | None = field(default=None, repr=False)
    copies: int = 1  # a prefilled row: how many batch rows share that one prefill (its time is split among them)
    placed_copies: int = 0  # a prefilled row: copies a ``DecodeBatch`` has placed (then its cache is freed)
    row_steps: np.ndarray | None = None
    timer: DeviceTimer | None = None
    # the pass in progress: its side streams, and the layers whose observation and eviction it forked there
    lanes: LayerLanes | None = field(default=None, repr=False)
    forked_layers: set[int] = field(default_factory=set, repr=False)
    _seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def __post_init__(self) -> None:
        if self.row_steps is None:
            self.row_steps = np.zeros(self.next_index.shape[0], np.int64)

    def set_layer_budgets(self, budgets: Tensor) -> None:
        """The rows' (L, B) layer budgets (``Method.layer_budgets``, computed on the host): kept on the host and
        copied to the device without waiting for the device's queue (a prompt pass's compressions are behind it)."""
        host = budgets.cpu()
        self.host_n_keep = host.numpy()
        self.layer_n_keep = host_to_device(host, self.engine.device)

    @property
    def prefill_seconds(self) -> float:
        """A prefilled row: the wall time of its prompt pass(es), compression and suffix (read from its events,
        waiting for them, where ``Engine.prefill_row(wait=False)`` left the work running)."""
        if isinstance(self._prefill, tuple):
            start, end = self._prefill
            end.synchronize()
            self._prefill = start.elapsed_time(end) / 1000
        return self._prefill

    @prefill_seconds.setter
    def prefill_seconds(self, seconds: float | tuple[torch.cuda.Event, torch.cuda.Event]) -> None:
        self._prefill = seconds

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
        plan, rope_positions = self.pass_plan(tokens.shape[1], phase, static_shapes)
        logits = self.engine._forward(tokens, plan.query_positions, rope_positions, self.cache, plan)
        self.after_pass(logits, phase)
        return logits

    @staticmethod
    def feed_together(sessions: list["Session"], tokens: Tensor, phase: str = "decode", static_shapes: bool = False,
                      composite: CompositeCache | None = None) -> Tensor:
        """``feed`` for several sessions over one model (each of its own engine: a method and budget), their rows
        stacked in ``tokens`` (R, q) in the sessions' order, in one forward pass: the weights are read once for
        all of them, and each session's rows attend over its own cache (through a ``CompositeCache``: the
        caller's ``composite`` over these sessions, or a new one). Returns the logits (R, q, V)."""
        if len(sessions) == 1:
            return sessions[0].feed(tokens, phase, static_shapes)
        composite = CompositeCache([s.cache for s in sessions]) if composite is None else composite
        plans = [session.pass_plan(tokens.shape[1], phase, static_shapes) for session in sessions]
        for session, (plan, _) in zip(sessions, plans):
            session.cache.plan = plan
        index = torch.cat([plan.query_positions for plan, _ in plans])
        logits = sessions[0].engine._forward(tokens, index, torch.cat([rope for _, rope in plans]), composite, None)
        for (start, rows, _), session in zip(composite.partitions, sessions):
            session.after_pass(logits[start:start + rows], phase)
        return logits

    def pass_plan(self, q: int, phase: str, static_shapes: bool) -> tuple[PassPlan, Tensor]:
        """The plan of a pass of q tokens per row, and the tokens' RoPE positions (B, q)."""
        if phase not in ("decode", "extend"):
            raise ConfigError(f"unknown feed phase '{phase}'; accepted: decode, extend")
        engine, method = self.engine, self.engine.method
        device = self.next_index.device
        index = self.next_index.view(-1, 1) + torch.arange(q, device=device)
        observing = method.compress_during_decode
        plan = PassPlan(query_positions=index, num_queries=torch.full((index.shape[0],), q, device=device),
                        wanted=method.needed_stats("decode") if observing else frozenset(), window=method.window,
                        static_shapes=static_shapes, expand=engine.expand, position_limit=self.position_limit(q))
        self.lanes, self.forked_layers = (LayerLanes(engine.device, LAYER_STREAMS) if observing else None), set()
        if observing and self.lanes.spread:
            plan.after_layer = partial(self._observe_and_compress_in_pass, phase == "decode", q)
        return plan, engine._rope_positions(self.cache, index)

    def position_limit(self, q: int) -> int:
        """A bound on every position stored or fed in the next pass of q tokens a row: the rows' next index plus q,
        rounded up to ``POSITION_LIMIT_STEP``, so that it stays the same over many decode steps (a captured step
        keeps it: ``kvbench.graphs`` captures again when it changes)."""
        longest = int(self.host_next_index.max(initial=0)) + q
        return -(-longest // POSITION_LIMIT_STEP) * POSITION_LIMIT_STEP

    def after_pass(self, logits: Tensor, phase: str) -> None:
        """What follows a pass whose logits (B, q, V) are ``logits``: the rows advance, and a method that compresses
        while decoding observes the pass and compresses where due."""
        q = logits.shape[1]
        self.next_index += q  # in place: a captured decode step keeps reading the same tensor
        self.host_next_index += q
        self.logits = logits[:, -1]
        if self.engine.method.compress_during_decode:
            decode = phase == "decode"
            self.decode_steps += decode
            self.row_steps += decode
            with self.timer.section("decode_compress"):
                self._observe_and_compress(compress=decode, q=q)

    def due_rows(self, ahead: int = 0) -> np.ndarray:
        """(B,) bool: the rows whose decode pass ``ahead`` passes from now compresses (if over budget)."""
        return (self.row_steps + ahead) % self.engine.method.decode_interval == 0

    def over_budget(self, index: int, lengths: np.ndarray, due: np.ndarray) -> np.ndarray:
        """(B,) bool: the ``due`` rows that layer ``index`` holding ``lengths`` (B, H) slots must compress."""
        return (lengths > self.host_n_keep[index][:, None]).any(-1) & due

    def eviction(self, index: int, lengths: np.ndarray, due: np.ndarray) -> str:
        """What decode-time compression does to layer ``index`` whose rows hold ``lengths`` (B, H) slots after
        the pass: "none", "in_place" (every row over budget by one: ``Method.evict_one``), "compress" (every row
        over budget: ``Method.compress``) or "rows" (``Method.compress`` on the rows over budget alone)."""
        over = self.over_budget(index, lengths, due)
        excess = lengths - self.host_n_keep[index][:, None]
        if not over.any():
            return "none"
        if not over.all():
            return "rows"
        return "in_place" if self.engine.in_place_eviction(1) and (excess == 1).all() else "compress"

    def _observe_and_compress_in_pass(self, decode: bool, q: int, index: int) -> None:
        """``PassPlan.after_layer`` of a pass whose lanes spread: layer ``index``'s observation and in-place
        eviction forked to its side stream right after its attention, so that they overlap the later layers'
        forward instead of following the pass (replayed 64k steps at batch 1 on an H200, against the lanes after
        the pass: D2O -2.7 %, CaM -2.3 %, H2O -1.3 %). They touch only the layer's own storage and state, which
        the rest of the pass does not read. A compression stays for after the pass, on the step's own stream: it
        allocates storage that the step goes on using."""
        layer = self.cache.layers[index]
        due = self.due_rows(ahead=1) if decode else np.zeros(len(self.row_steps), bool)  # after_pass's due rows
        action = self.eviction(index, layer.host_lengths, due) if due.any() else "none"
        if action == "none" or (action == "in_place" and q == 1):
            with torch.inference_mode(), self.lanes.fork(index):
                self._observe_and_compress_layer(index, layer, action, due, q)
            self.forked_layers.add(index)

    def _observe_and_compress(self, compress: bool, q: int) -> None:
        """Every layer's observation and eviction that the pass did not fork, in line, then the join of the pass's
        lanes."""
        lanes, forked = self.lanes, self.forked_layers
        self.lanes, self.forked_layers = None, set()
        due = self.due_rows() if compress else np.zeros(len(self.row_steps), bool)
        with torch.inference_mode():
            for index, layer in enumerate(self.cache.layers):
                if index not in forked:
                    action = self.eviction(index, layer.host_lengths, due) if due.any() else "none"
                    self._observe_and_compress_layer(index, layer, action, due, q)
        if lanes is not None:
            lanes.join()

    def _observe_and_compress_layer(self, index: int, layer: CompressedLayer, action: str, due: np.ndarray,
                                    q: int) -> None:
        """Layer ``index``'s observation of the pass, then its ``action`` (``eviction``)."""
        engine, method = self.engine, self.engine.method
        stats = self.cache.pass_stats[index]
        one_in_place = action == "in_place" and q == 1
        if not one_in_place:
            method.observe(index, layer.kv, stats)
        if one_in_place and method.unrotates_in_place:
            stats.rope = engine.rope  # the step un-RoPEs the keys it reads, not a copy of the cache
        elif action != "none":  # the raw keys un-RoPE the stored keys, which observing leaves as they are
            stats = engine.with_raw_keys(layer.kv, stats, method.decode_needs, decoding=True)
        if one_in_place:
            method.observe_and_evict_one(index, layer.kv, stats, self.layer_n_keep[index])
            layer.removed_one()
        elif action in ("in_place", "compress"):
            kv, stats = engine._ordered(layer.kv, layer.ordered, stats)
            layer.store(method.compress(index, kv, stats, self.layer_n_keep[index], "decode"))
        elif action == "rows":
            rows = np.flatnonzero(self.over_budget(index, layer.host_lengths, due))
            taken = torch.as_tensor(rows, device=layer.kv.keys.device)
            kv, stats = engine._ordered(layer.kv.take_rows(taken), layer.ordered, stats.take_rows(taken))
            layer.store_rows(rows, method.compress(index, kv, stats, self.layer_n_keep[index][taken],
                                                   "decode"))

    # -- rows in slots --------------------------------------------------------------------------------

    @classmethod
    def allocate(cls, like: "Session", batch: int, capacities: list[int], first: list[int] | None = None
                 ) -> "Session":
        """``batch`` empty slots shaped like the prefilled row ``like``, layer l at ``capacities[l]`` slots: the
        static storage that rows are placed into (``place``). ``first``: slots that ``like`` is placed into as each
        layer is allocated, ``like``'s own layer released once copied (every copy of it is placed here, and
        ``like`` is not read again), so that the row and the storage never both hold every layer: a full cache's
        first placement no longer doubles its memory."""
        engine = like.engine
        cache = CompressedCache(engine.num_layers)
        rows = None if first is None else np.asarray(first)
        for mine, theirs, capacity in zip(cache.layers, like.cache.layers, capacities):
            # outside inference mode: steps update the storage in place
            if rows is not None and batch == 1:  # the storage's only row: its own storage, or one copy a tensor
                mine.allocate_alone(theirs, capacity)
            else:
                mine.allocate(theirs, batch, capacity)
                if rows is not None:
                    with torch.inference_mode():
                        mine.place(rows, theirs, capacity)
            if rows is not None:
                theirs.kv = None
        L, H = like.prefill_lengths.shape[0], like.prefill_lengths.shape[2]
        session = cls(engine, cache, next_index=like.next_index.new_zeros(batch),
                      layer_n_keep=like.layer_n_keep.new_zeros(L, batch),
                      host_n_keep=np.zeros((L, batch), like.host_n_keep.dtype),
                      host_next_index=np.zeros(batch, np.int64),
                      logits=like.logits.new_zeros(batch, like.logits.shape[-1]),
                      prefill_lengths=like.prefill_lengths.new_zeros(L, batch, H), kv_bytes_full=[0] * batch,
                      kv_bytes_compressed=[0] * batch, prompt_lengths=[0] * batch, timer=DeviceTimer(engine.device))
        if rows is not None:
            session._place_row(rows, like)
        return session

    def place(self, slots: list[int], row: "Session", capacities: list[int]) -> None:
        """Copy the prefilled one-row session ``row`` into ``slots`` (each gets a copy), in place: storage rows,
        per-row device tensors (a captured decode step keeps reading them) and their host mirrors; layer l's
        storage grows to at least ``capacities[l]`` slots first (what the row needs while it decodes)."""
        rows = np.asarray(slots)
        with torch.inference_mode():
            for mine, theirs, capacity in zip(self.cache.layers, row.cache.layers, capacities):
                mine.place(rows, theirs, capacity)
        self._place_row(rows, row)

    def _place_row(self, rows: np.ndarray, row: "Session") -> None:
        """``place``'s per-row tensors and host records of ``row`` in ``rows`` (its layers are placed)."""
        index = row_index(rows, self.next_index.device)
        with torch.inference_mode():  # the logits after a pass are an inference tensor
            self.next_index[index] = row.next_index[0]
            self.layer_n_keep[:, index] = row.layer_n_keep[:, :1].to(self.layer_n_keep.dtype)
            self.logits[index] = row.logits[0].to(self.logits.dtype)
        self.host_n_keep[:, rows] = row.host_n_keep[:, :1]
        self.host_next_index[rows] = row.host_next_index[0]
        self.prefill_lengths[:, torch.as_tensor(rows)] = row.prefill_lengths[:, :1]
        for b in rows.tolist():
            self.kv_bytes_full[b], self.kv_bytes_compressed[b] = row.kv_bytes_full[0], row.kv_bytes_compressed[0]
            self.prompt_lengths[b] = row.prompt_lengths[0]
        self.row_steps[rows] = 0

    def clear(self, slots: list[int]) -> None:
        """Empty ``slots`` (length 0 in every layer): finished rows of a method that never compresses while
        decoding, which would otherwise grow until they outgrow the storage."""
        for layer in self.cache.layers:
            layer.clear_rows(np.asarray(slots))


class Engine:
    """model + method + budget. ``attn_implementation`` is the wrapped implementation (eager/sdpa/flash).

    prefill_chunk_size: run each prompt in chunks of this many tokens with compression between chunks (peak
    memory follows the budget instead of the prompt); None = one pass. [I] With chunks, the method compresses
    after every chunk, seeing for every cached slot its attention summed over all prompt queries so far
    (``column_sums``) and the chunk's own last ``window`` queries (``window_column_sums``).
    cuda_graphs: replay decode steps as CUDA graphs (``kvbench.graphs``); "auto": on for a CUDA model.
    batch_size: rows ``generate`` decodes together (continuous batching, ``kvbench.decode``); None: every prompt
    of a call at once; "auto": as many as free device memory holds (``kvbench.decode.auto_batch_size``).
    compile: run one-token passes through compiled decoder layers (``kvbench.compile``): true, false or auto.
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
        cuda_graphs: bool | str = "auto",
        decode_path: str = "in_place",
        batch_size: int | str | None = None,
        compile: str | bool = "auto",
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
        if cuda_graphs not in (True, False, "auto"):
            raise ConfigError(f"engine.cuda_graphs={cuda_graphs!r}; accepted: true, false, auto")
        if cuda_graphs is True and self.device.type != "cuda":
            raise ConfigError(f"engine.cuda_graphs=true needs a CUDA model; this one is on {self.device}")
        self.cuda_graphs_setting = cuda_graphs
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs == "auto" else cuda_graphs
        if batch_size is not None and batch_size != "auto" and (
                isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
            raise ConfigError(f"batch_size={batch_size!r}; accepted: an integer >= 1 or auto")
        self.batch_size = batch_size
        self.on_generation: Callable[[], None] | None = None  # called as each generated row finishes (progress)
        self.compile_decode = compile_enabled(compile, self.device, self.cuda_graphs)
        if self.compile_decode:
            prepare_compiled_calls(model)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # what a pass's attention reads instead of a method's stored slots (PassPlan.expand)
        self.expand = partial(method.expand, rotate=partial(rotate_keys, model)) if method.expands_slots else None
        self.rope = Rope(model) if method.unrotates_in_place else None
        dtype = next(model.parameters()).dtype
        if self.rope is not None and self.cuda_graphs and self.rope.frequencies is not None and dtype in (
                torch.bfloat16, torch.float16):
            self.rope.table(dtype)  # for the Triton step's RoPE, made now: never inside a captured decode step

    def with_method(self, method: Method, budget: Budget) -> "Engine":
        """The same model and engine settings with another method and budget (reference systems)."""
        return Engine(self.model, method, budget, self.attn_implementation, self.position_mode,
                      self.prefill_chunk_size, self.cuda_graphs_setting, self.decode_path, self.batch_size,
                      self.compile_decode)

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
        try:
            with torch.inference_mode(), attach(self.model, self.attn_implementation), compiled_decode(
                    self.model, self.compile_decode and tokens.shape[1] == 1):
                out = self.model(input_ids=tokens, position_ids=rope_positions,
                                 **{cache_keyword(type(self.model)): cache}, use_cache=True, kvbench_cache=cache,
                                 logits_to_keep=logits_to_keep)
        finally:  # a prompt pass's plan calls back into its session (after_layer): a cycle through the cache that
            cache.plan = None  # would keep the whole cache alive until the garbage collector runs
        return out.logits

    def with_raw_keys(self, kv: LayerKV, stats: AttentionStats, needs: frozenset[str],
                      decoding: bool = False) -> AttentionStats:
        """``stats`` with the layer's raw (un-RoPE'd) keys where ``needs`` asks for them. ``decoding``: a decode
        step's, through the compiled function when the engine compiles its steps (static shapes; every decode
        step of a run, in place or through ``compress``, gets the same kernels; the last bit of a raw key may
        differ from the eager one, as inductor keeps the float32 products it fuses)."""
        if "raw_keys" in needs:
            unrotate = compiled_function(unrotate_keys) if decoding and self.compile_decode else unrotate_keys
            stats.raw_keys = unrotate(self.model, kv.keys, kv.positions)
        return stats

    @staticmethod
    def _ordered(kv: LayerKV, ordered: bool, stats: AttentionStats) -> tuple[LayerKV, AttentionStats]:
        """A layer's cache in original-token order with padding cleared, and the statistics moved with it, as
        ``Method.compress`` expects (in-place removals leave slots unordered and padding stale); ``ordered``:
        the slots already are."""
        if ordered:
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

        ``suffixes`` (e.g. the question in query-agnostic mode) are fed after the row's prefill compression. A row
        repeated in the batch is prefilled once: its outputs are the same."""
        rows: dict[tuple, Session] = {}
        keys = []
        for b, prompt in enumerate(prompts):
            suffix = suffixes[b] if suffixes is not None else []
            keys.append((tuple(prompt), tuple(suffix)))
            if keys[-1] not in rows:
                rows[keys[-1]] = self.prefill_row(prompt, max_new_tokens, suffix)
        return rows[keys[0]] if len(keys) == 1 else self._batch([rows[key] for key in keys])

    def prefill_row(self, prompt: list[int], max_new_tokens: int, suffix: list[int] | None = None,
                    wait: bool = True) -> Session:
        """One prompt's pass(es) with compression, then its suffix: a one-row session, its storage planned for
        ``max_new_tokens`` of decoding, timed (``Session.prefill_seconds``). ``wait=False`` (CUDA): return once
        the work is queued, timed by events around it, so that the caller queues more work behind it while the
        device runs it (a decode batch places the row and records its step's graph: ``kvbench.decode``)."""
        if len(prompt) == 0:
            raise ConfigError("empty prompt: every sample needs at least one token")
        n_keep = self.budget.n_keep(torch.tensor([len(prompt)]), max_new_tokens, self.method.budget_basis)
        _sync(self.device)
        start = time.perf_counter()
        timed_by_events = not wait and self.device.type == "cuda"
        if timed_by_events:
            began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began.record()  # on an idle device: it times from now, as the host clock does
        row = self._prefill_row(prompt, n_keep, max_new_tokens, suffix or [], DeviceTimer(self.device))
        if timed_by_events:
            ended.record()
            row.prefill_seconds, row.prefill_end = (began, ended), ended
        else:
            _sync(self.device)
            row.prefill_seconds, row.prefill_end = time.perf_counter() - start, clock_mark(self.device)
        return row

    def _prefill_row(self, prompt: list[int], n_keep: Tensor, max_new_tokens: int, suffix: list[int],
                     timer: DeviceTimer) -> Session:
        method, L, n = self.method, self.num_layers, len(prompt)
        session = self.new_row(n, timer)
        cache = session.cache
        # host copies through pinned memory: a later chunk's query count and the suffix are copied behind the queued
        # pass, which a copy from pageable memory would wait for
        tokens = host_to_device(torch.tensor([prompt]), self.device)
        per_layer = not method.budget_needs
        if per_layer:  # budgets from the prompt length alone: known before the pass
            session.set_layer_budgets(self.budgets_before_pass(n_keep, n, max_new_tokens))
        statistics = None if per_layer else BudgetStatistics(method, cache, L)  # one pass: no chunks (__init__)
        chunk = self.prefill_chunk_size or n
        observed = [None] * L  # chunked: column sums of every slot over all prompt queries so far, by position
        logits = None
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            index = torch.arange(start, stop, device=self.device).view(1, -1)

            def compress_layer(layer: int) -> None:
                stats = self._prompt_stats(cache, layer, observed, stop, start > 0)
                self.compress_prompt_layer(session, layer, cache.kv(layer), cache.layers[layer].host_lengths, stats)
                cache.pass_stats[layer] = AttentionStats()  # drop the prompt statistics once used

            queries = host_to_device(torch.tensor([stop - start]), self.device)
            plan = PassPlan(query_positions=index, num_queries=queries,
                            wanted=method.needs, window=method.window,
                            after_layer=compress_layer if per_layer else statistics.take, expand=self.expand,
                            position_limit=stop)
            logits = self._forward(tokens[:, start:stop], index, index, cache, plan, logits_to_keep=1)
            if not per_layer:
                stats = [self._prompt_stats(cache, layer, observed, stop, start > 0) for layer in range(L)]
                self.compress_after_pass(session, n_keep, stats, max_new_tokens,
                                         budget_stats=statistics.budget_stats(torch.tensor([n])))
        self.finish_row(session, n, logits, len(suffix), max_new_tokens)
        if suffix:
            session.feed(host_to_device(torch.tensor([suffix]), self.device), phase="extend")
        return session

    def new_row(self, prompt_length: int, timer: DeviceTimer) -> Session:
        """An empty single-row session whose prompt of ``prompt_length`` tokens is about to be prefilled."""
        return Session(self, CompressedCache(self.num_layers),
                       next_index=torch.full((1,), prompt_length, device=self.device), layer_n_keep=None,
                       host_n_keep=None, host_next_index=np.array([prompt_length], np.int64), timer=timer)

    def budgets_before_pass(self, n_keep: Tensor, prompt_length: int, max_new_tokens: int) -> Tensor:
        """(L, 1) layer budgets (host) of a method whose budgets need no statistics (known from the length alone)."""
        stats = [AttentionStats(num_queries=torch.tensor([prompt_length]))] * self.num_layers
        return self.method.layer_budgets(n_keep, self.num_layers, stats, max_new_tokens)

    def compress_prompt_layer(self, session: Session, layer: int, kv: LayerKV, host_lengths: np.ndarray,
                              stats: AttentionStats, own: Callable[[int, LayerKV], LayerKV] | None = None) -> None:
        """Compress a prompt layer ``kv`` (its lengths on the host: ``host_lengths``) into the row's cache (timed as
        prefill compression), reading nothing back where the method's sizes follow from the host's
        (``Method.kept_lengths``). ``own(layer, kv)`` makes the result the row's own storage where the method
        returned shared tensors (a prompt pass shared by several rows, ``kvbench.shared_prefill``)."""
        host = HostSizes(n_keep=session.host_n_keep[layer], lengths=host_lengths)
        with session.timer.section("compress"):
            compressed = self.method.compress(layer, kv, stats, session.layer_n_keep[layer], "prefill", host)
            session.cache.set_kv(layer, compressed if own is None else own(layer, compressed),
                                 self.method.kept_lengths(layer, host))

    def compress_after_pass(self, session: Session, n_keep: Tensor, stats: list[AttentionStats],
                            max_new_tokens: int, own: Callable[[int, LayerKV], LayerKV] | None = None,
                            budget_stats: list[AttentionStats] | None = None) -> None:
        """A method whose layer budgets need every layer's statistics (``Method.budget_needs``): the budgets (from
        ``budget_stats`` where the pass took them, ``BudgetStatistics``, else from ``stats``), then every layer
        compressed, after the prompt pass."""
        session.set_layer_budgets(self.budgets_after_pass(n_keep, budget_stats or stats, max_new_tokens))
        self.compress_kept_layers(session, stats, own)

    def budgets_after_pass(self, n_keep: Tensor, stats: list[AttentionStats], max_new_tokens: int) -> Tensor:
        """(L, B) layer budgets (host) of a method whose budgets need every layer's statistics ``stats``."""
        return self.method.layer_budgets(n_keep, self.num_layers, stats, max_new_tokens)

    def compress_kept_layers(self, session: Session, stats: list[AttentionStats],
                             own: Callable[[int, LayerKV], LayerKV] | None = None, start: int = 0) -> None:
        """Layers ``start`` on of a row that kept its uncompressed layers through the pass, compressed at its
        layer budgets, each with its statistics ``stats[layer]``, which are then dropped."""
        for layer in range(start, self.num_layers):
            stored = session.cache.layers[layer]
            self.compress_prompt_layer(session, layer, stored.kv, stored.host_lengths, stats[layer], own)
            session.cache.pass_stats[layer] = AttentionStats()

    def finish_row(self, session: Session, prompt_length: int, logits: Tensor, suffix_length: int,
                   max_new_tokens: int) -> None:
        """After the prompt pass and its compression: the row's records, its storage planned for what follows
        (a suffix of ``suffix_length`` tokens, fed uncompressed by the caller, then decoding). logits: (1, q, V)
        of the pass."""
        cache = session.cache
        session.logits = logits[:, -1]
        session.prefill_lengths = cache.lengths()
        session.kv_bytes_full = [prompt_length * self._token_bytes(cache)]
        session.kv_bytes_compressed = [self.row_bytes(cache, 0)]
        session.prompt_lengths = [prompt_length]
        self._plan_capacity(session, extra=suffix_length, max_new_tokens=max_new_tokens)

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

    def planned_capacities(self, row: Session, max_new_tokens: int, extra: int = 0) -> list[int]:
        """Slots every layer of ``row`` needs from now on: ``extra`` more tokens (its suffix), then decoding up to
        the next compression (budget + decode_interval) or, for prompt-only methods, every new token."""
        method, capacities = self.method, []
        for index, layer in enumerate(row.cache.layers):
            length = layer.longest + extra
            if method.compress_during_decode:
                keep = int(row.host_n_keep[index].max())
                capacities.append(min(length + max_new_tokens, max(keep, length) + method.decode_interval))
            else:
                capacities.append(length + max_new_tokens)
        return capacities

    def batch_capacities(self, row: Session, max_new_tokens: int) -> list[int]:
        """Slots every layer of a decode batch's storage gets when ``row``, its longest prompt, allocates it:
        what ``row`` needs (``planned_capacities``), which no later, shorter prompt's row exceeds, except at a
        method whose per-layer size the prompt's content decides (D2O's layer budgets, KVMerger's thresholds:
        ``Method.budget_needs``, not ``keeps_within_budget``). Growing storage under a running batch
        re-captures its graph and compiles kernels for the new shapes, so such a method's layers get
        ``DATA_DRIVEN_HEADROOM`` of the row's mean layer size more, never more than the row's uncompressed
        prompt, suffix and new tokens would fill."""
        planned = self.planned_capacities(row, max_new_tokens)
        if not self.method.budget_needs and self.method.keeps_within_budget:
            return planned
        suffix = row.cache.layers[0].longest - int(row.prefill_lengths[0, 0].max())
        limit = row.prompt_lengths[0] + suffix + max_new_tokens
        room = int(DATA_DRIVEN_HEADROOM * sum(planned) / len(planned))
        return [max(capacity, min(capacity + room, limit)) for capacity in planned]

    def _plan_capacity(self, session: Session, extra: int, max_new_tokens: int) -> None:
        """Re-allocate every layer once for what comes next (``planned_capacities``)."""
        for layer, capacity in zip(session.cache.layers, self.planned_capacities(session, max_new_tokens, extra)):
            if capacity != layer.kv.capacity:
                layer.kv.resize(max(capacity, layer.longest))
            layer.kv.pack_state()

    def _batch(self, rows: list[Session]) -> Session:
        """The rows in one static storage (``Session.place``), every layer at the largest row's capacity."""
        capacities = [max(row.cache.layers[index].kv.capacity for row in rows) for index in range(self.num_layers)]
        session = Session.allocate(rows[0], len(rows), capacities)
        slots: dict[int, list[int]] = defaultdict(list)
        unique = {id(row): row for row in rows}
        for b, row in enumerate(rows):
            slots[id(row)].append(b)
        for key, row in unique.items():
            session.place(slots[key], row, capacities)
        session._seconds["compress"] = sum(row.compress_seconds for row in unique.values())
        return session

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
        batch_size: int | str | None = None,
    ) -> list[Generation]:
        """Greedy decoding. ``suffixes`` (e.g. the question in query-agnostic mode) are fed after the prefill
        compression and never compressed at prefill; ``stop_token_ids`` end a row (not included in its output);
        ``stop_when(tokens)`` ends a row once it returns True for the row's output so far (stop strings).
        ``batch_size``: rows decoded together (default: the engine's), see ``kvbench.decode.decode_prompts``."""
        from kvbench.decode import DecodeRequest, decode_prompts  # it builds on Session and Generation

        request = DecodeRequest(max_new_tokens, frozenset(stop_token_ids), min_new_tokens, stop_when)
        with PeakMemory(self.device, baseline=self.weight_bytes) as peak, attach(self.model, self.attn_implementation):
            gens = decode_prompts(self, prompts, suffixes, request,
                                  self.batch_size if batch_size is None else batch_size)
        self.record_peak(gens, peak.bytes)
        return gens

    def record_peak(self, gens: list[Generation], peak: int) -> None:
        """Set the peak memory (``PeakMemory.bytes`` with the weights as its baseline) of the block that made
        ``gens`` on each of them."""
        for gen in gens:
            gen.peak_memory_bytes, gen.peak_memory_above_weights_bytes = peak, peak - self.weight_bytes
