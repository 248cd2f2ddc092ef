"""Decode steps replayed as one CUDA graph (``engine.cuda_graphs``).

A decode step of the engine is a fixed sequence of kernels once its host decisions stop changing: the
storage is static, row lengths live on the device and in the host mirror, a method that evicts every step
does it in place, and the next tokens are picked on the device. ``DecodeGraph`` runs the step of a set of
sessions (one forward pass over all their rows, ``kvbench.decode.DecodeBatch``): it waits for that steady
state, runs one eager step with static shapes (it compiles every kernel that the captured step will launch and
creates whatever state a method makes on its first step), captures the next step, and from then on replays
it; a step whose methods, storage shapes and state were warmed up so before in this process (an earlier
batch's, e.g. a benchmark's previous repeat) is captured at once. A step whose host decisions differ (a compression through
``Method.compress``, a cache that must grow) runs eagerly, and a graph whose storage was re-allocated is
captured again.

The host side of a replay (each layer's mirror growing or shrinking by what the captured step did, the
sessions' step counters) is applied lazily: replays only count themselves until something reads the mirrors
(``flush``: the next eager step, an admission, the end), so a steady step costs the host one replay call.
Decode-time compression inside a replayed step is part of its time (``decode_compress_seconds`` counts the
eager compressions only).
"""

from __future__ import annotations

import functools
import gc
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from kvbench.engine import Session

# signatures (``DecodeGraph._signature``) of steps that ran eagerly with static shapes in this process
WARMED: set[tuple] = set()


@functools.cache
def capture_stream() -> torch.cuda.Stream:
    """The side stream every capture records on (a capture cannot record on the default stream), one per process.
    Of the highest priority: torch instantiates graphs with their kernels' captured priorities
    (``cudaGraphInstantiateFlagUseNodePriority``), so a replayed step's own kernels take a multiprocessor before the
    kernels of its layers' side lanes (``engine.LayerLanes``, default priority) whenever both wait for one; the
    lanes' work is off the step's critical path, and their wide grids otherwise delay the step's next kernel."""
    return torch.cuda.Stream(priority=-1)


class DecodeGraph:
    """Runs decode steps of ``sessions`` (``body(static_shapes)`` does one: every session's rows), replaying a
    captured step once every session is steady."""

    def __init__(self, sessions: list["Session"], body: Callable[[bool], object], key: tuple = ()) -> None:
        self.sessions = sessions
        self.body = body
        self.key = key  # what else shapes the body's kernels (the caller's own switches)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captured: tuple | None = None  # the host decisions and storage versions of the captured step
        self.warm: tuple | None = None  # those of the last eager static-shape step (the capture's warm-up)
        self.delta: list[list[int]] = []  # per session and layer: what a replay adds to every row
        self.ordered: list[list[bool]] = []
        self.logits: list[Tensor] = []  # per session: the graph's output buffer, rewritten by every replay
        self.bytes_delta: list[int] = []  # per session: what a replay adds to each row's K+V bytes
        self.safe = 0  # replays known to take the captured decisions
        self.pending = 0  # replays whose host side is not applied yet
        self.replays = 0
        self.kind = ""  # what the last step was: "replay", "capture", "warm-up" (eager, static shapes) or "eager"
        self.capture_host: Counter[str] = Counter()  # host seconds of its captures: "recording", "instantiating"

    def step(self) -> bool:
        """One decode step; True when it was a replay whose host side is pending (``flush``)."""
        self.kind = "replay"
        if self.safe > 0:  # known to take the captured step's decisions: no per-layer checks
            self._replay()
            return True
        self.flush()
        decisions = self._decisions()
        if decisions is None:  # a compression through Method.compress, or storage that must grow
            self.kind, self.warm = "eager", None
            self.body(False)
        elif decisions == self.captured:
            self._replay()
            self.flush()
            self.safe = self._safe_replays()
        elif decisions != self.warm and (signature := self._signature(decisions)) not in WARMED:
            self.kind = "warm-up"
            self.body(True)
            self.warm = decisions
            WARMED.add(signature)
        else:
            self.kind = "capture"
            self._capture(decisions)
        return False

    def flush(self) -> None:
        """Apply the host side of the pending replays: every session's mirrors, step counters and logits."""
        count, self.pending = self.pending, 0
        if not count:
            return
        for session, deltas, ordered, logits in zip(self.sessions, self.delta, self.ordered, self.logits):
            for layer, delta, is_ordered in zip(session.cache.layers, deltas, ordered):
                if delta:
                    layer.shift(delta * count)
                layer.ordered = is_ordered
            session.decode_steps += count
            session.row_steps += count
            session.host_next_index += count
            session.logits = logits

    def invalidate(self) -> None:
        """The mirrors changed outside a step (rows placed or emptied): check the next step's decisions."""
        self.flush()
        self.safe = 0

    def _replay(self) -> None:
        self.graph.replay()
        self.pending += 1
        self.replays += 1
        self.safe -= 1

    def _capture(self, decisions: tuple) -> None:
        """Record one step into a new graph. Not through ``torch.cuda.graph``, which empties the allocator's caches
        before every capture: the memory a prompt pass had cached would be given back to the driver and
        allocated again by the next pass, a cost of every decode batch. The garbage collector waits while the
        step is recorded: recording allocates Python objects at the pace of an eager step, and a full
        collection of a process that holds a run's tables and compiled code would pause it for tens of ms.
        Nor after waiting for the device: recording runs nothing, so the host records while the device still runs
        the work queued before (a newly placed row's prompt pass, ``Engine.prefill_row(wait=False)``), and the
        replay that runs the captured step is queued behind that work."""
        before = [[layer.host_lengths.copy() for layer in s.cache.layers] for s in self.sessions]
        self.graph = torch.cuda.CUDAGraph()
        collecting = gc.isenabled()
        gc.disable()
        start = time.perf_counter()
        try:
            with torch.cuda.stream(capture_stream()):
                self.graph.capture_begin()
                try:
                    self.body(True)  # recorded, not run: host side only
                finally:
                    recorded = time.perf_counter()
                    self.graph.capture_end()
        finally:
            if collecting:
                gc.enable()
        self.capture_host["recording"] += recorded - start
        self.capture_host["instantiating"] += time.perf_counter() - recorded
        self.delta, self.bytes_delta = [], []
        for session, lengths in zip(self.sessions, before):
            deltas = [layer.host_lengths - b for layer, b in zip(session.cache.layers, lengths)]
            assert all((d == d.flat[0]).all() for d in deltas), "a captured step changes every row alike"
            self.delta.append([int(d.flat[0]) for d in deltas])
            self.bytes_delta.append(sum(int(d.flat[0]) * d.shape[1] * layer.kv.slot_bytes
                                        for d, layer in zip(deltas, session.cache.layers)))
        self.ordered = [[layer.ordered for layer in s.cache.layers] for s in self.sessions]
        self.logits = [s.logits for s in self.sessions]
        self.captured = decisions
        self.graph.replay()  # the captured step itself (its host side already happened during the capture)
        self.safe = self._safe_replays()

    def _safe_replays(self) -> int:
        """How many next steps certainly take the captured decisions: until a growing row fills its storage or
        reaches its budget or, for a method that compresses every few steps, until a row's next due step."""
        safe = 1 << 30
        for session, deltas in zip(self.sessions, self.delta):
            method = session.engine.method
            for index, (layer, delta) in enumerate(zip(session.cache.layers, deltas)):
                if not delta:
                    continue
                safe = min(safe, layer.kv.capacity - layer.longest)
                if method.compress_during_decode and method.decode_interval == 1:  # a row reaching its budget
                    safe = min(safe, int((session.host_n_keep[index][:, None] - layer.host_lengths).min()))
            if method.compress_during_decode and method.decode_interval > 1:
                safe = min(safe, int(((-(session.row_steps + 1)) % method.decode_interval).min()))
            if session.engine.expand is not None:  # the steps that keep the captured position limit
                safe = min(safe, session.position_limit(1) - int(session.host_next_index.max(initial=0)))
        return max(safe, 0)

    def _signature(self, decisions: tuple) -> tuple:
        """What the kernels of a step taking ``decisions`` depend on: every session's method and storage shapes
        and state (a method may create state on its first step), without the storage's identity."""
        shapes = tuple((repr(s.engine.method), s.engine.position_mode, tuple(
            (layer.kv.keys.shape, layer.kv.keys.dtype, tuple(sorted(layer.kv.state)),
             tuple((name, t.shape) for name, t in sorted(layer.kv.tables.items()))) for layer in s.cache.layers))
            for s in self.sessions)
        return tuple(action for action, _ in decisions), shapes, self.key

    def _decisions(self) -> tuple | None:
        """What the next step does on the host, per session and layer: nothing, or an in-place eviction; None
        when it needs an eager step (storage growth, ``Method.compress``). With the storage versions, so that
        re-allocated storage is captured again, and the position limit of a method that expands its slots (its
        kernels' widths)."""
        plan = []
        for session in self.sessions:
            method = session.engine.method
            if session.engine.expand is not None:
                plan.append(("position_limit", session.position_limit(1)))
            due = session.due_rows(ahead=1) if method.compress_during_decode else None
            for index, layer in enumerate(session.cache.layers):
                if layer.longest + 1 > layer.kv.capacity:
                    return None
                action = "none" if due is None or not due.any() else session.eviction(
                    index, layer.host_lengths + 1, due)
                if action not in ("none", "in_place"):
                    return None
                plan.append((action, layer.storage_version))
        return tuple(plan)
