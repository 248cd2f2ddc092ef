"""Chelsea's clustering steps planned on the host, from the row lengths and budgets alone (one read-back).

How many slots a CSM step merges in a row depends only on counts, never on the keys: the row's region (its
length minus the protected windows), the chunk geometry, the ratio r and the excess over the budget. A chunk of
L >= 2 region slots gives every one of its ceil(L / 2) A slots an edge (a chunk of one slot gives none), and a
step merges min(excess, max(1, floor(r * region)), edges) of them. So the whole schedule, every step's merge
counts and row lengths, is known before the first step runs, and the steps run without reading anything back.
This assumes finite keys (a cosine that is NaN makes no edge; a model producing NaN keys is broken anyway).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from kvbench.kv import host_to_device


@dataclass
class PlannedStep:
    """One step on the host, every array (B, H) int64: ``start`` (the sinks) and ``region``, where the
    clusterable slots begin and how many are matched (0 on rows that merge nothing this step, so they get no
    edge); ``merges``, the A slots it merges; ``edges``, the A slots with an edge; ``lengths``, the rows after
    it."""

    start: np.ndarray
    region: np.ndarray
    merges: np.ndarray
    edges: np.ndarray
    lengths: np.ndarray

    @property
    def every_edge(self) -> bool:
        """Whether every row merges all its edges (no ranking of edges needed)."""
        return bool((self.merges == self.edges).all())


@dataclass
class DeviceStep:
    """A planned step as the device runs it: ``start``, ``region``, ``merges``, ``lengths`` (B, H) long device
    tensors, plus the host numbers that size its tensors."""

    start: Tensor
    region: Tensor
    merges: Tensor
    lengths: Tensor
    longest_region: int
    longest_row: int
    every_edge: bool


def windows(target: np.ndarray, sinks: int, recent: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row (sinks, recent) of a (B, H) budget: both shrink (recent first kept) so that the budget holds
    them plus one slot."""
    row_recent = np.minimum(recent, target - 1)
    return np.minimum(sinks, target - 1 - row_recent), row_recent


def edge_count(region: np.ndarray, chunk_size: int | None) -> np.ndarray:
    """(B, H): A slots with an edge when each row's ``region`` is cut into chunks as ``chunked_soft_matching``
    cuts it (chunks of min(chunk_size, longest region) slots)."""
    longest = int(region.max()) if region.size else 0
    if longest < 2:
        return np.zeros_like(region)
    size = longest if chunk_size is None else min(chunk_size, longest)
    full, rest = np.divmod(region, size)
    return full * ((size + 1) // 2) + np.where(rest >= 2, (rest + 1) // 2, 0)


def plan_step(lengths: np.ndarray, target: np.ndarray, sinks: int, recent: int, chunk_size: int | None,
              r: float) -> PlannedStep:
    """One CSM step at ratio ``r`` on every row above its ``target``; arrays (B, H) int64."""
    row_sinks, row_recent = windows(target, sinks, recent)
    region = np.clip(lengths - row_sinks - row_recent, 0, None)
    excess = np.clip(lengths - target, 0, None)
    region = np.where(excess > 0, region, 0)
    edges = edge_count(region, chunk_size)
    per_step = np.maximum(np.floor(r * region.astype(np.float64)).astype(np.int64), 1)
    merges = np.minimum(np.minimum(excess, per_step), edges)
    if not merges.any():
        raise RuntimeError(f"chelsea: no edge left to merge (lengths {lengths.tolist()}, target {target.tolist()})")
    return PlannedStep(start=row_sinks, region=region, merges=merges, edges=edges, lengths=lengths - merges)


def plan_steps(lengths: np.ndarray, target: np.ndarray, sinks: int, recent: int, chunk_size: int | None,
               ratio: Callable[[int], float]) -> list[PlannedStep]:
    """Every step until each row fits its ``target``; step t merges at ratio ``ratio(t)``."""
    steps: list[PlannedStep] = []
    while (lengths > target).any():
        steps.append(plan_step(lengths, target, sinks, recent, chunk_size, ratio(len(steps))))
        lengths = steps[-1].lengths
    return steps


def upload(steps: list[PlannedStep], device: torch.device) -> list[DeviceStep]:
    """The planned steps on ``device`` in one copy (``host_to_device``: no wait on the device)."""
    if not steps:
        return []
    host = torch.from_numpy(np.stack([np.stack([s.start, s.region, s.merges, s.lengths]) for s in steps]))
    planned = host_to_device(host, device)
    return [DeviceStep(*tensors.unbind(0), longest_region=int(s.region.max()), longest_row=int(s.lengths.max()),
                       every_edge=s.every_edge) for s, tensors in zip(steps, planned.unbind(0))]
