"""Decode steps replayed as one CUDA graph (``engine.cuda_graphs=true``).

A decode step of the engine is a fixed sequence of kernels once its host decisions stop changing: the
storage is static, row lengths live on the device and in the host mirror, a method that evicts every step
does it in place. ``DecodeGraph`` waits for that steady state, runs one eager step with static shapes (it
compiles every kernel that the captured step will launch), captures the next step, and from then on replays
it, applying the step's host-side effects (the mirror's row lengths, the step counter) that the capture
recorded. A step whose host decisions differ (a compression through ``Method.compress`` at a decode
interval, a cache that must grow) runs eagerly, and a graph whose storage was re-allocated is captured again.
Decode-time compression inside a replayed step is part of its time (``decode_compress_seconds`` counts the
eager compressions only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from kvbench.engine import Session


class DecodeGraph:
    """Runs ``session.feed(tokens)`` decode steps, replaying a captured step once the session is steady."""

    def __init__(self, session: "Session") -> None:
        self.session = session
        B = len(session.host_n_keep[0])
        self.tokens = torch.zeros(B, 1, dtype=torch.long, device=session.engine.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captured: tuple | None = None  # the host decisions and storage versions of the captured step
        self.warm: tuple | None = None  # those of the last eager static-shape step (the capture's warm-up)
        self.delta: list[int] = []  # what a replay adds to every row of each layer
        self.ordered: list[bool] = []
        self.safe = 0  # replays known to take the captured decisions
        self.logits: Tensor | None = None
        self.replays = 0

    def step(self, tokens: Tensor) -> None:
        """One decode step with ``tokens`` (B,); ``session.logits`` holds the next logits afterwards."""
        session = self.session
        self.tokens.copy_(tokens.view(-1, 1))
        if self.safe > 0:  # known to take the captured step's decisions: no per-layer checks
            self._replay()
            return
        decisions = self._decisions()
        if decisions is None:  # a compression through Method.compress, or storage that must grow
            self.warm = None
            session.feed(self.tokens, phase="decode")
        elif decisions == self.captured:
            self._replay()
            self.safe = self._safe_replays()
        elif decisions != self.warm:
            session.feed(self.tokens, phase="decode", static_shapes=True)
            self.warm = decisions
        else:
            self._capture(decisions)

    def _replay(self) -> None:
        session = self.session
        self.graph.replay()
        session.logits = self.logits  # an eager step in between pointed the session at its own logits
        for layer, delta, ordered in zip(session.cache.layers, self.delta, self.ordered):
            if delta:
                layer.shift(delta)
            layer.ordered = ordered
        session.decode_steps += 1
        self.replays += 1
        self.safe -= 1

    def _capture(self, decisions: tuple) -> None:
        session = self.session
        before = [layer.host_lengths.copy() for layer in session.cache.layers]
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            session.feed(self.tokens, phase="decode", static_shapes=True)  # recorded, not run: host side only
        deltas = [layer.host_lengths - b for layer, b in zip(session.cache.layers, before)]
        assert all((d == d.flat[0]).all() for d in deltas), "a captured step changes every row alike"
        self.delta = [int(d.flat[0]) for d in deltas]
        self.ordered = [layer.ordered for layer in session.cache.layers]
        self.logits = session.logits  # the graph's output buffer, rewritten by every replay
        self.captured = decisions
        self.graph.replay()  # the captured step itself (its host side already happened during the capture)
        self.safe = self._safe_replays()

    def _safe_replays(self) -> int:
        """How many next steps certainly take the captured decisions: until a growing row fills its storage
        or, for a method that compresses every few steps, until the next due step."""
        session, method = self.session, self.session.engine.method
        safe = 1 << 30
        for index, (layer, delta) in enumerate(zip(session.cache.layers, self.delta)):
            if not delta:
                continue
            safe = min(safe, layer.kv.capacity - layer.longest)
            if method.compress_during_decode:  # a row reaching its budget makes a due step compress
                safe = min(safe, int((session.host_n_keep[index][:, None] - layer.host_lengths).min()))
        if method.compress_during_decode and method.decode_interval > 1:
            safe = min(safe, -(session.decode_steps + 1) % method.decode_interval)
        return max(safe, 0)

    def _decisions(self) -> tuple | None:
        """What the next step does on the host, per layer: nothing, or an in-place eviction; None when it needs
        an eager step (storage growth, ``Method.compress``). With the storage versions, so that re-allocated
        storage is captured again."""
        session = self.session
        engine, method = session.engine, session.engine.method
        due = method.compress_during_decode and (session.decode_steps + 1) % method.decode_interval == 0
        plan = []
        for index, layer in enumerate(session.cache.layers):
            if layer.longest + 1 > layer.kv.capacity:
                return None
            excess = layer.host_lengths + 1 - session.host_n_keep[index][:, None]
            if not due or not (excess > 0).any():
                plan.append(("none", layer.storage_version))
            elif engine.in_place_eviction(1) and (excess == 1).all():
                plan.append(("in_place", layer.storage_version))
            else:
                return None
        return tuple(plan)
