"""The decode loop: rows of one or several points decoded together, one forward pass per step for all of them.

``DecodeBatch(points=[engine, ...], slots=8)``: every point (an ``Engine``: a method and budget over the shared
model) holds ``slots`` rows of static-capacity storage (a ``Session``). Prefilled one-row sessions
(``Engine.prefill_row``, or rows a caller prefilled itself) are admitted with their decoding request (``admit``);
a waiting row takes a free slot of its point before the next step, so the batch stays full (continuous
batching), and its storage, per-row device tensors (next index, budgets, first token, stop masks) and host
mirrors are written in place. A step feeds every slot's token through one forward pass (a ``CompositeCache``
when there are several points: the weights are read once for all of them), runs each point's decode-time
observation and compression on its rows, and picks every row's next token on the device (argmax, a row's stop
tokens masked before its ``min_new_tokens``): nothing in a step waits for the device. The tokens reach the
host through a pinned buffer and an event ``lag`` steps later (1 on CUDA): the host checks the stops of step k
while the device runs step k+1, so a row that stopped is computed once more and that token is discarded.

A slot that no row waits for keeps stepping harmlessly: a method that compresses while decoding keeps its old
row at the budget; for the others the row is emptied (it would grow) and emptied again before it could
outgrow the storage. Storage is allocated for the first row, layer by layer as that row is copied into it
(its own layers released as they go, ``Session.allocate``), at ``Engine.batch_capacities`` (budget + decode
interval, or + max_new_tokens for prompt-only methods, with room where the data decides a layer's size), and
grows to what every admitted row needs, which re-captures a replayed step, so ``decode_prompts`` admits the
longest prompts first. With ``engine.cuda_graphs`` the whole step, every point included, is replayed as one
CUDA graph (``kvbench.graphs``).

Placing a row does not wait for its prompt pass where the row's first token cannot end it (``_first_token``):
``decode_prompts`` prefills with ``Engine.prefill_row(wait=False)``, and the host places the row and records the
step's graph while the device still runs the pass; the first token reaches the host with the row's first step.
Recorded after the pass instead, a capture left the device idle for its 30-100 ms of host time, which a timed
64-token decode at 32k counted as 5-15 % of its TPOT.

Timing without synchronising: a step's device time runs from the previous step's end event to its own (from its
own start after an admission, so prompt passes are not counted), read when its tokens are. A row's TPOT is the
mean over its steps; its decode time is its share of each step (the step's time over the rows it decoded).
"""

from __future__ import annotations

import logging
import math
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvbench.attention import attach
from kvbench.cache import CompositeCache
from kvbench.engine import Engine, Generation, Session, _sync, clock_mark
from kvbench.graphs import DecodeGraph
from kvbench.hardware import free_memory_bytes
from kvbench.kv import host_to_device

log = logging.getLogger("kvbench")
CPU_AUTO_BATCH = 8  # batch_size=auto on a CPU: decoding is compute-bound there, a larger batch gains little
STEP_KINDS = ("replay", "capture", "warm-up", "eager")  # ``_Step.kind``, in the order the batch's log lists them
AUTO_MARGIN = 0.05  # batch_size=auto: the share of the device's memory left free (graph pools, fragmentation)


@dataclass(frozen=True)
class DecodeRequest:
    """How one row decodes: greedily, at most ``max_new_tokens``; ``stop_token_ids`` end it (not included) but
    cannot be picked before ``min_new_tokens`` tokens; ``stop_when(tokens)`` ends it once True (stop strings)."""

    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    min_new_tokens: int = 0
    stop_when: Callable[[list[int]], bool] | None = None


def _stop_ids(request: DecodeRequest, device: torch.device) -> Tensor:
    """The request's stop token ids on ``device``, copied without waiting for the work queued there."""
    return host_to_device(torch.tensor(sorted(request.stop_token_ids)), device)


@dataclass
class Finished:
    """A row that finished decoding: its point, the tag it was admitted with, and its output."""

    point: int
    tag: Any
    generation: Generation


@dataclass
class _Flight:
    """A row being decoded in slot ``row`` (its index in the whole batch)."""

    point: int
    row: int
    source: Session
    request: DecodeRequest
    tag: Any
    first_token: Tensor | None = None  # (1,) on the device, picked from its prefill logits at admission
    first_on_host: Tensor | None = None  # its copy on its way to the host: read with the row's first step
    tokens: list[int] = field(default_factory=list)
    placed: int = 0  # steps launched before its first one
    compress_mark: float = 0.0  # its point's decode-time compression seconds when it was placed
    kv_read: float = 0.0  # K+V bytes its steps' attention read
    steps: int = 0


@dataclass
class _Point:
    engine: Engine
    first: int  # its first row in the batch
    session: Session | None = None  # its slots' storage, allocated when its first row arrives
    waiting: deque = field(default_factory=deque)  # (row, request, tag)
    flights: dict[int, _Flight] = field(default_factory=dict)  # batch row -> row in flight
    emptied: int = 0  # steps launched when its free slots were last emptied (prompt-only methods) ...
    empty: frozenset = frozenset()  # ... and those slots (batch rows)


@dataclass
class _Step:
    number: int
    members: list[_Flight]  # the rows in flight when it was launched
    bytes_before: np.ndarray  # (R,) every row's K+V bytes before it
    end: Any  # CUDA event (or host time) after its tokens were copied out
    kind: str  # "replay", "capture", "warm-up" or "eager" (``DecodeGraph.kind``; "eager" without graphs)
    start: Any = None  # CUDA event (or host time) before it, when the previous step's end does not bound it


class DecodeBatch:
    """Rows of ``points`` (engines sharing one model) decoded together, ``slots`` rows per point.

        batch = DecodeBatch([engine_a, engine_b], slots=8)
        batch.admit(0, row, DecodeRequest(30, eos_ids), tag=sample_id)   # row: a prefilled one-row Session
        while batch.busy:
            for done in batch.step(): ...                                 # Finished(point, tag, generation)
            (admit more rows while batch.vacancies(point) > 0)
        batch.close()

    ``lag``: steps between a step and the host reading its tokens (default 1 on CUDA, 0 on a CPU, where every
    operation has finished when it returns)."""

    def __init__(self, points: Sequence[Engine], slots: int, lag: int | None = None) -> None:
        if not points or slots < 1:
            raise ValueError(f"a decode batch needs points and slots >= 1 (got {len(points)} points, {slots} slots)")
        model = points[0].model
        if any(p.model is not model or p.attn_implementation != points[0].attn_implementation for p in points):
            raise ValueError("the points of a decode batch share one model and attention implementation")
        self.points = [_Point(engine, first=p * slots) for p, engine in enumerate(points)]
        self.slots = slots
        self.device = points[0].device
        self.graphs = points[0].cuda_graphs
        self.lag = (1 if self.device.type == "cuda" else 0) if lag is None else lag
        R = len(points) * slots
        self.tokens = torch.zeros(R, 1, dtype=torch.long, device=self.device)  # every row's next input token
        self.generated = torch.zeros(R, dtype=torch.long, device=self.device)  # tokens each row has picked
        self.min_new = torch.zeros(R, dtype=torch.long, device=self.device)
        self.stop_mask: Tensor | None = None  # (R, V) bool, from the first row whose stops need masking
        pinned = self.device.type == "cuda"
        # named "cpu": under a CUDA default device (torch.set_default_device) a pinned buffer would be refused
        self.host_tokens = [torch.zeros(R, dtype=torch.long, device="cpu", pin_memory=pinned)
                            for _ in range(self.lag + 1)]
        self.row_bytes = np.zeros(R)  # every row's K+V bytes now (from the host mirrors)
        self.token_bytes = np.zeros(R)  # the K+V bytes of one token of each row (every layer and head)
        self.records: deque[_Step] = deque()  # launched steps whose tokens are not read yet
        self.launched = 0
        self.steps_by_kind: Counter[str] = Counter()  # launched steps per ``_Step.kind``
        self.seconds_by_kind: defaultdict[str, float] = defaultdict(float)  # their device seconds (read steps)
        self.capture_host: Counter[str] = Counter()  # host seconds of the captures (``DecodeGraph.capture_host``)
        self.clock = [0.0]  # device seconds of all decode steps up to step n (index n)
        self.share = [0.0]  # the same, each step's seconds divided among the rows it decoded
        self.last_end: Any = None
        # the next step's time starts afresh (first step, after an admission): where the newest placed row's
        # prefill ended (its first token: the time to its second one includes placing it and recording the
        # step's graph), else at the step's launch; otherwise where the step before it ended
        self.restart = True
        self.restart_from: Any = None
        self.attachment = ExitStack()  # the model switched to kvbench's attention from the first step to close()
        self.attached = False
        self.built = False  # the step's composite cache, row selection and graph runner match the points
        self.runner: DecodeGraph | None = None
        self.composite: CompositeCache | None = None
        self.rows: Tensor | None = None  # the allocated points' rows when not all points are, in batch order
        self._bytes_delta: tuple | None = None  # (captured decisions, (R,) bytes a replay adds to each row)
        self.finished_early: list[Finished] = []  # rows that finished when ``place`` placed them

    # -- what callers ask -----------------------------------------------------------------------------

    def admit(self, point: int, row: Session, request: DecodeRequest, tag: Any = None) -> None:
        """Queue the prefilled one-row session ``row`` (prefilled by ``point``'s engine) on ``point``; it takes
        a free slot at the next step. A row admitted several times decodes in as many slots (``row.copies``
        splits its prefill time among them)."""
        if row.engine is not self.points[point].engine:
            raise ValueError(f"point {point}: a row is admitted on the point whose engine prefilled it")
        self.points[point].waiting.append((row, request, tag))

    def vacancies(self, point: int) -> int:
        """Free slots of ``point`` that no waiting row has claimed."""
        p = self.points[point]
        return self.slots - len(p.flights) - len(p.waiting)

    @property
    def replays(self) -> int:
        """Steps that were graph replays."""
        return self.steps_by_kind["replay"]

    @property
    def busy(self) -> bool:
        """Rows are waiting, being decoded, or finished at their placement and not yet returned by ``step``."""
        return bool(self.finished_early) or any(p.waiting or p.flights for p in self.points)

    def place(self) -> None:
        """Place the waiting rows into free slots now rather than at the next step: a placed row's prefilled
        cache is freed (``_place``), so a caller that prefills several prompts before the first step holds one
        prefilled row at a time instead of all of them. Rows that finish at placement come with the next step."""
        self.finished_early += self._place()

    def step(self) -> list[Finished]:
        """Place waiting rows into free slots, run one decode step, and read the tokens of the step ``lag``
        before it; returns the rows that finished (at their admission or in the step read)."""
        if not self.attached:  # kvbench's attention until close(): switching it walks the whole model
            engine = self.points[0].engine
            self.attachment.enter_context(attach(engine.model, engine.attn_implementation))
            self.attached = True
        finished, self.finished_early = self.finished_early + self._place(), []
        in_flight = any(p.flights for p in self.points)
        if in_flight:
            self._launch()
        while self.records and (self.records[0].number <= self.launched - self.lag or not in_flight):
            finished += self._collect(self.records.popleft())
        return finished

    def close(self) -> None:
        """Wait for the steps still running (their tokens are nobody's), release the captured graph and give the
        model its attention implementation back."""
        _sync(self.device)
        self.records.clear()
        self._drop_runner()
        if self.launched:  # why a batch decodes slower than its graph would: eager steps, captures, warm-ups
            kinds = ", ".join(f"{self.steps_by_kind[kind]} {kind} {self.seconds_by_kind[kind]:.3f} s"
                              for kind in STEP_KINDS if self.steps_by_kind[kind])
            if self.capture_host:  # what a capture's seconds are made of on the host
                kinds += "; captures on the host: " + ", ".join(
                    f"{phase} {seconds:.3f} s" for phase, seconds in self.capture_host.items())
            log.info("decode batch of %d points x %d slots: %d steps (%s)", len(self.points), self.slots,
                     self.launched, kinds, extra={"steps_by_kind": dict(self.steps_by_kind),
                                                  "seconds_by_kind": dict(self.seconds_by_kind),
                                                  "capture_host_seconds": dict(self.capture_host)})
        self.attachment.close()
        self.attached = False

    # -- admission ------------------------------------------------------------------------------------

    def _place(self) -> list[Finished]:
        finished = []
        for index, point in enumerate(self.points):
            free = [point.first + s for s in range(self.slots) if point.first + s not in point.flights]
            placed: dict[tuple, tuple[Session, list[int]]] = {}  # (row, request) -> the row and its slots
            first_tokens: dict[tuple, tuple[Tensor, Tensor | None]] = {}
            while point.waiting and free:
                row, request, tag = point.waiting.popleft()
                flight = _Flight(index, -1, row, request, tag)
                if request.max_new_tokens < 1:
                    finished.append(Finished(index, tag, self._generation(flight, "max_new_tokens", self.launched)))
                    continue
                key = (id(row), request)
                if key not in first_tokens:
                    first_tokens[key] = self._first_token(row, request)
                flight.first_token, flight.first_on_host = first_tokens[key]
                stopped = None if flight.first_on_host is not None else self._accept(flight, int(flight.first_token))
                if stopped is not None:
                    finished.append(Finished(index, tag, self._generation(flight, stopped, self.launched)))
                    continue
                flight.row = free.pop(0)
                placed.setdefault(key, (row, []))[1].append(flight.row)
                point.flights[flight.row] = flight
            newly_free = point.session is not None and not point.engine.method.compress_during_decode and bool(
                set(free) - point.empty)
            if placed or newly_free:
                self._install(point, list(placed.values()), free)
            for row, slots in placed.values():
                row.placed_copies += len(slots)
                if row.placed_copies == row.copies:  # every copy is in its slot: its own cache is not read again
                    row.cache = None
        return finished

    @staticmethod
    def _first_token(row: Session, request: DecodeRequest) -> tuple[Tensor, Tensor | None]:
        """A row's first token, picked on the device from its prefill logits: (1,), and, where that token cannot
        end the row (a decode of at least two tokens, no stop strings, no stop token pickable first), its copy
        on its way to the host. Such a row is placed without waiting for its prompt pass, so that the device
        runs the pass while the host places the row and records the step's graph; the copy is read with the
        row's first step. Any other row's token is read at once (``_place`` waits for its prompt pass)."""
        logits = row.logits
        if request.min_new_tokens > 0 and request.stop_token_ids:
            # out of place: an inference tensor
            logits = logits.index_fill(1, _stop_ids(request, logits.device), -float("inf"))
        first = logits.argmax(-1)
        can_stop = request.max_new_tokens < 2 or request.stop_when is not None or (
            request.stop_token_ids and request.min_new_tokens < 1)
        if can_stop:
            return first, None
        on_host = torch.empty(1, dtype=first.dtype, device="cpu", pin_memory=first.is_cuda)
        return first, on_host.copy_(first, non_blocking=True)

    def _install(self, point: _Point, placed: list[tuple[Session, list[int]]], free: list[int]) -> None:
        """Write newly placed rows into their point's storage (allocating it for the first row) and the per-row
        device tensors a step reads; empty free slots of a method that never compresses while decoding."""
        self._flush()
        engine, slot = point.engine, lambda row: row - point.first
        for row, rows in placed:
            request = point.flights[rows[0]].request  # the same for every slot of a group
            if row.prefill_end is not None:  # rows are placed in the order they were prefilled
                self.restart_from = row.prefill_end
            capacities = engine.planned_capacities(row, request.max_new_tokens)
            if point.session is None:
                storage = engine.batch_capacities(row, request.max_new_tokens)
                # free slots of a method that compresses while decoding hold copies: every row alike at its budget
                copies = list(range(self.slots)) if engine.method.compress_during_decode else [slot(r) for r in rows]
                if row.placed_copies + len(rows) == row.copies:  # its last copies: placed as the storage is made
                    point.session = Session.allocate(row, self.slots, storage, copies)
                else:
                    point.session = Session.allocate(row, self.slots, storage)
                    point.session.place(copies, row, capacities)
                self._drop_runner()
            else:
                point.session.place([slot(r) for r in rows], row, capacities)
            index = host_to_device(torch.as_tensor(rows), self.device)  # a copy that does not wait for the pass
            self.tokens[index] = point.flights[rows[0]].first_token.view(1, 1)
            # filled, not assigned: assigning a number copies it to the device from pageable memory, which waits
            self.generated.index_fill_(0, index, 1)
            self.min_new.index_fill_(0, index, request.min_new_tokens)
            if request.min_new_tokens > 1 and request.stop_token_ids:
                if self.stop_mask is None:
                    self.stop_mask = torch.zeros(len(self.tokens), point.session.logits.shape[-1], dtype=torch.bool,
                                                 device=self.device)
                    self._drop_runner()
                self.stop_mask.index_fill_(0, index, False)
                self.stop_mask.index_put_((index.view(-1, 1), _stop_ids(request, self.device)),
                                          torch.ones((), dtype=torch.bool, device=self.device))
            elif self.stop_mask is not None:
                self.stop_mask.index_fill_(0, index, False)
            compress_mark = point.session.decode_compress_seconds
            for r in rows:
                point.flights[r].placed, point.flights[r].compress_mark = self.launched, compress_mark
        if free and not engine.method.compress_during_decode:
            point.session.clear([slot(r) for r in free])
            point.emptied, point.empty = self.launched, frozenset(free)
        session = point.session
        self.row_bytes[point.first:point.first + self.slots] = session.cache.row_bytes()
        self.token_bytes[point.first:point.first + self.slots] = Engine._token_bytes(session.cache)
        self.restart = True
        if self.runner is not None:
            self.runner.invalidate()

    # -- steps ----------------------------------------------------------------------------------------

    def _launch(self) -> None:
        self._empty_outgrowing()
        if not self.built:
            self._build_runner()
        start = None
        if self.restart:
            start = self.restart_from if self.restart_from is not None else clock_mark(self.device)
            self.restart_from = None
        members = [flight for p in self.points for flight in p.flights.values()]
        bytes_before = self.row_bytes.copy()
        replayed = self.runner.step() if self.runner is not None else self._body(False)
        kind = self.runner.kind if self.runner is not None else "eager"
        self.launched += 1
        self.steps_by_kind[kind] += 1
        buffer = self.host_tokens[self.launched % len(self.host_tokens)]
        buffer.copy_(self.tokens.view(-1), non_blocking=True)
        self.records.append(_Step(self.launched, members, bytes_before, clock_mark(self.device), kind, start))
        self.restart = False
        if replayed:
            self.row_bytes += self._replay_bytes()
        else:
            for point in self.points:
                if point.session is not None:
                    self.row_bytes[point.first:point.first + self.slots] = point.session.cache.row_bytes()

    def _collect(self, record: _Step) -> list[Finished]:
        """Read step ``record``'s tokens: every row it decoded takes its token, and the rows that stop leave."""
        members = [f for f in record.members if self.points[f.point].flights.get(f.row) is f]  # not stopped before
        seconds = self._seconds(record)
        self.seconds_by_kind[record.kind] += seconds
        self.clock.append(self.clock[-1] + seconds)
        self.share.append(self.share[-1] + seconds / max(1, len(members)))
        tokens = self.host_tokens[record.number % len(self.host_tokens)].tolist()
        finished = []
        for flight in members:
            r = flight.row
            if flight.first_on_host is not None:  # its copy was queued before this step, which has ended
                self._accept(flight, flight.first_on_host.tolist()[0])  # cannot end the row (``_first_token``)
                flight.first_on_host = None
            flight.kv_read += record.bytes_before[r] + self.token_bytes[r]
            flight.steps += 1
            stopped = self._accept(flight, tokens[r])
            if stopped is not None:
                del self.points[flight.point].flights[r]
                finished.append(Finished(flight.point, flight.tag, self._generation(flight, stopped, record.number)))
        return finished

    @staticmethod
    def _accept(flight: _Flight, token: int) -> str | None:
        request = flight.request
        if token in request.stop_token_ids:
            return "eos"
        flight.tokens.append(token)
        if request.stop_when is not None and request.stop_when(flight.tokens):
            return "stop_string"
        return "max_new_tokens" if len(flight.tokens) >= request.max_new_tokens else None

    def _body(self, static_shapes: bool) -> bool:
        """One step's device work: every allocated point's rows through one forward pass, each point's decode
        compression, the next tokens picked into ``tokens``. Returns False (its host side is done)."""
        sessions = [p.session for p in self.points if p.session is not None]
        tokens = self.tokens if self.rows is None else self.tokens[self.rows]
        logits = Session.feed_together(sessions, tokens, "decode", static_shapes, self.composite)[:, -1]
        picked = self._pick(logits)
        if self.rows is None:
            self.tokens.copy_(picked)
        else:
            self.tokens.index_copy_(0, self.rows, picked)
        self.generated += 1
        return False

    def _pick(self, logits: Tensor) -> Tensor:
        """(R', V) -> (R', 1) greedy tokens; a row's stop tokens cannot be picked before its min_new_tokens."""
        if self.stop_mask is not None:
            rows = slice(None) if self.rows is None else self.rows
            blocked = self.stop_mask[rows] & (self.generated[rows] < self.min_new[rows]).unsqueeze(-1)
            logits = logits.masked_fill(blocked, -float("inf"))
        return logits.argmax(-1, keepdim=True)

    def _empty_outgrowing(self) -> None:
        """Empty again the free slots of prompt-only methods before they could outgrow their storage."""
        for point in self.points:
            session = point.session
            if session is None or point.engine.method.compress_during_decode:
                continue
            room = min(layer.kv.capacity for layer in session.cache.layers)
            free = [point.first + s for s in range(self.slots) if point.first + s not in point.flights]
            if free and self.launched - point.emptied >= room - 1:
                self._install(point, [], free)

    # -- graphs, mirrors, clocks ----------------------------------------------------------------------

    def _build_runner(self) -> None:
        allocated = [p for p in self.points if p.session is not None]
        sessions = [p.session for p in allocated]
        self.rows = None if len(allocated) == len(self.points) else torch.cat(
            [torch.arange(p.first, p.first + self.slots, device=self.device) for p in allocated])
        self.composite = CompositeCache([s.cache for s in sessions]) if len(sessions) > 1 else None
        key = (self.stop_mask is not None, len(self.tokens))
        self.runner = DecodeGraph(sessions, self._body, key) if self.graphs else None
        self.built = True

    def _drop_runner(self) -> None:
        """Forget the step's graph (the set of points or the step's kernels change); its host side first."""
        self._flush()
        if self.runner is not None:
            self.capture_host += self.runner.capture_host
        self.runner = self.composite = None
        self.built = False

    def _flush(self) -> None:
        if self.runner is not None:
            self.runner.flush()

    def _replay_bytes(self) -> np.ndarray:
        """(R,) what one replay adds to every row's K+V bytes (constant between captures)."""
        if self._bytes_delta is None or self._bytes_delta[0] is not self.runner.captured:
            delta = np.zeros(len(self.row_bytes))
            allocated = [p for p in self.points if p.session is not None]
            for point, added in zip(allocated, self.runner.bytes_delta):
                delta[point.first:point.first + self.slots] = added
            self._bytes_delta = (self.runner.captured, delta)
        return self._bytes_delta[1]

    def _seconds(self, record: _Step) -> float:
        """Device seconds of step ``record`` (its end event is waited for: its tokens are read next)."""
        begin = record.start if record.start is not None else self.last_end
        self.last_end = record.end
        if self.device.type != "cuda":
            return record.end - begin
        record.end.synchronize()
        return begin.elapsed_time(record.end) / 1000

    def _generation(self, flight: _Flight, stopped: str, last: int) -> Generation:
        """The output of a row whose last step was ``last`` (or which stopped at admission)."""
        source, point = flight.source, self.points[flight.point]
        if flight.steps:
            after = next((r.bytes_before for r in self.records if r.number == last + 1), self.row_bytes)
            final, compress = float(after[flight.row]), point.session.decode_compress_seconds - flight.compress_mark
        else:
            final, compress = Engine.row_bytes(source.cache, 0), 0.0
        return Generation(
            tokens=flight.tokens,
            prompt_length=source.prompt_lengths[0],
            kept_per_layer_head=source.prefill_lengths[:, 0].tolist(),
            n_keep=int(round(float(source.host_n_keep[:, 0].mean()))),
            kv_bytes_full=source.kv_bytes_full[0],
            kv_bytes_compressed=source.kv_bytes_compressed[0],
            kv_bytes_final=int(final),
            decode_kv_bytes_mean=flight.kv_read / flight.steps if flight.steps else float("nan"),
            prefill_seconds=source.prefill_seconds / source.copies,
            compress_seconds=source.compress_seconds / source.copies,  # its events, read once the row has decoded
            decode_seconds=self.share[last] - self.share[flight.placed] if flight.steps else 0.0,
            decode_compress_seconds=compress / self.slots,
            tpot_seconds=(self.clock[last] - self.clock[flight.placed]) / flight.steps if flight.steps else 0.0,
            first_step_seconds=self.clock[flight.placed + 1] - self.clock[flight.placed] if flight.steps else math.nan,
            tpot_after_first_seconds=(self.clock[last] - self.clock[flight.placed + 1]) / (flight.steps - 1)
            if flight.steps > 1 else math.nan,
            peak_memory_bytes=0,
            peak_memory_above_weights_bytes=0,
            stopped_by=stopped,
            batch_size=self.slots,
        )


def decode_prompts(engine: Engine, prompts: list[list[int]], suffixes: list[list[int]] | None,
                   request: DecodeRequest, batch_size: int | str | None) -> list[Generation]:
    """``Engine.generate``: the prompts decoded through one ``DecodeBatch`` of ``batch_size`` slots (None: every
    prompt at once; "auto": ``auto_batch_size``), longest prompt first, each finished row's slot taking the next
    prompt. A prompt repeated with its suffix is prefilled once and its copies are admitted together."""
    if not prompts:
        return []
    groups: dict[tuple, list[int]] = {}
    for b, prompt in enumerate(prompts):
        groups.setdefault((tuple(prompt), tuple(suffixes[b] if suffixes is not None else [])), []).append(b)
    pending = deque(sorted(groups.items(), key=lambda item: -(len(item[0][0]) + len(item[0][1]))))
    results: list[Generation | None] = [None] * len(prompts)
    batch: DecodeBatch | None = None
    current: tuple[Session, list[int]] | None = None  # a prefilled row and the copies of it not yet admitted
    try:
        while pending or current is not None or batch.busy:
            if current is None and pending and (batch is None or batch.vacancies(0) > 0):
                (prompt, suffix), copies = pending.popleft()
                row = engine.prefill_row(list(prompt), request.max_new_tokens, list(suffix), wait=False)
                row.copies = len(copies)
                current = (row, list(copies))
                if batch is None:
                    slots = len(prompts) if batch_size is None else (
                        auto_batch_size(engine, row, request, len(prompts)) if batch_size == "auto" else batch_size)
                    batch = DecodeBatch([engine], min(slots, len(prompts)))
            if current is not None:
                row, copies = current
                admitted = copies[:batch.vacancies(0)]
                for b in admitted:
                    batch.admit(0, row, request, tag=b)
                batch.place()
                del copies[:len(admitted)]
                current = None if not copies else current
                if batch.vacancies(0) > 0 and (pending or current is not None):
                    continue  # fill every free slot before the next step
            for done in batch.step():
                results[done.tag] = done.generation
                if engine.on_generation is not None:
                    engine.on_generation()
    finally:
        if batch is not None:
            batch.close()
    return results


def storage_bytes_per_row(engine: Engine, row: Session, max_new_tokens: int) -> int:
    """Bytes one slot of ``engine``'s storage takes when it is planned for ``row`` (keys, values, positions,
    per-slot state, tables)."""
    total = 0
    for layer, capacity in zip(row.cache.layers, engine.batch_capacities(row, max_new_tokens)):
        kv, heads = layer.kv, layer.kv.lengths.shape[1]
        per_slot = kv.slot_bytes + kv.positions.element_size() + 4 * len(kv.state)
        total += heads * (capacity * per_slot + kv.table_bytes)
    return total


def step_activation_bytes_per_row(engine: Engine, capacity: int) -> int:
    """An estimate of what a decode step allocates per row beyond its storage: the logits (and the picked
    token's float copy), one layer's hidden and MLP activations, and the decode kernel's per-slot step
    attention over ``capacity`` slots (methods that observe it)."""
    config = engine.model.config
    dtype = next(engine.model.parameters()).element_size()
    heads = config.num_attention_heads
    hidden = config.hidden_size * 8 + getattr(config, "intermediate_size", 4 * config.hidden_size) * 3
    return config.vocab_size * 8 + hidden * dtype + 3 * heads * capacity * 4


def auto_batch_size(engine: Engine, row: Session, request: DecodeRequest, rows: int) -> int:
    """``batch_size=auto``: the slots that fit the device's free memory beside what is allocated now, each at
    the storage ``row`` needs (``storage_bytes_per_row``) plus a step's activations, keeping room for the next
    prompt pass (``row``'s prefill peak above what it kept, measured) and ``AUTO_MARGIN`` of the device.
    At most ``rows``; on a CPU at most ``CPU_AUTO_BATCH``."""
    if engine.device.type != "cuda":
        return max(1, min(rows, CPU_AUTO_BATCH))
    capacity = max(engine.batch_capacities(row, request.max_new_tokens))
    per_row = storage_bytes_per_row(engine, row, request.max_new_tokens) + step_activation_bytes_per_row(engine,
                                                                                                          capacity)
    prompt_pass = torch.cuda.max_memory_allocated(engine.device) - torch.cuda.memory_allocated(engine.device)
    total = torch.cuda.get_device_properties(engine.device).total_memory
    available = free_memory_bytes(engine.device) - prompt_pass - AUTO_MARGIN * total
    return max(1, min(rows, math.floor(available / per_row)))
