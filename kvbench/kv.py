"""The data a method sees and returns: one layer's ragged per-head KV storage, and attention statistics.

Storage is *padded + lengths*, left-aligned: row ``(b, h)`` holds ``lengths[b, h]`` real slots at indices
``[0, lengths[b, h])`` in original order; slots past the length are padding that attention never reads.
Tensors keep ``num_key_value_heads`` heads (never the repeated GQA heads), so compression really shrinks
the stored tensors: after a method returns, the storage is re-allocated at the new maximum length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kvbench.kernels.append import append_slots
from kvbench.kernels.lut_expand import fold_entries
from kvbench.kernels.slots import budget_victim, evict_in_budget, evict_lowest, move_last_into, select_lowest

if TYPE_CHECKING:
    from kvbench.attention import Rope


def _at_slots(t: Tensor, capacity: int, fill: float, dim: int) -> Tensor:
    """A copy of ``t`` at ``capacity`` slots along ``dim``: its first slots, or all of them and ``fill`` after."""
    grow = capacity - t.shape[dim]
    if grow <= 0:
        return t.narrow(dim, 0, capacity).clone()
    return F.pad(t, [0, 0] * (t.dim() - 1 - dim) + [0, grow], value=fill)


def host_to_device(host: Tensor, device: torch.device) -> Tensor:
    """A host tensor on ``device`` without waiting for the device: through pinned memory, asynchronously, on
    CUDA (a copy from pageable memory first waits for the work queued on the stream). A tensor made on the device
    already (torch's default device set to CUDA, as the CUDA kernel tests do) is returned as it is."""
    if device.type == "cuda" and host.device.type == "cpu":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


@dataclass(frozen=True)
class HostSizes:
    """What the host knows of a ``compress`` call's sizes before the call: with it, the call shapes its kernels
    without reading a size back from the device. A read waits for all the work queued before it, and a fused
    sweep's prompt pass compresses every layer of a dozen points while the device runs the next layers.

    n_keep:  (B,) int64, each batch row's budget (the call's ``n_keep``, as the host holds it).
    lengths: (B, H) int64, the input rows' lengths (the call's ``kv.lengths``).
    """

    n_keep: np.ndarray
    lengths: np.ndarray

    def kept(self) -> np.ndarray:
        """(B, H) ``min(budget, length)``: what each head keeps at a method that keeps its budget."""
        return np.minimum(self.n_keep[:, None], self.lengths)

    def most_kept(self) -> list[int]:
        """Per batch row, its longest head after a compression to ``kept`` (``keep_topk``'s ``row_sizes``)."""
        return self.kept().max(-1).tolist()

    def kept_alike(self) -> bool:
        """Whether every head of every row keeps as many slots (``kept``): storage compressed to them has no
        padding."""
        kept = self.kept()
        return bool((kept == kept.flat[0]).all()) if kept.size else True


@dataclass
class LayerKV:
    """One layer's cache.

    keys, values: (B, H_kv, T, D), post-RoPE keys as the model cached them.
    positions:    (B, H_kv, T) long, the original token index of each slot (a merged slot keeps its pivot's).
    lengths:      (B, H_kv) long, number of real slots per row.
    state:        name -> (B, H_kv, T) per-slot method state (accumulated attention, merge mass, ...);
                  it moves with its slot on every gather and new slots start at zero.
    tables:       name -> (B, H_kv, E) per-row tables a method keeps beside its slots (EMS's look-up table of
                  merged members). Entries name slots by position, never by index, so tables do not move with
                  slots: every gather, resize and removal carries them unchanged; -1 marks an unused entry.
                  A table has a fixed size E, all of it counted in the cache's bytes.
    state_block:  (S, B, H_kv, T) float32 when every state entry is a view of it (``pack_state``: the
                  engine's decode storage), so that an in-place slot move takes one operation for all states.
    """

    keys: Tensor
    values: Tensor
    positions: Tensor
    lengths: Tensor
    state: dict[str, Tensor] = field(default_factory=dict)
    tables: dict[str, Tensor] = field(default_factory=dict)
    state_block: Tensor | None = field(default=None, repr=False)
    _state_views: tuple = field(default=(), init=False, repr=False, compare=False)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def max_length(self) -> int:
        return int(self.lengths.max()) if self.lengths.numel() else 0

    def valid(self) -> Tensor:
        """(B, H, T) bool: True on real slots."""
        slots = torch.arange(self.capacity, device=self.keys.device)
        return slots.view(1, 1, -1) < self.lengths.unsqueeze(-1)

    def gather(self, index: Tensor, lengths: Tensor, host: HostSizes | None = None) -> "LayerKV":
        """Keep slots ``index`` (B, H, K) of every row; entries at or past ``lengths`` (B, H) are padding.

        Every kept slot carries its key, value, position and state along; the result is allocated at K slots.
        ``host``: the compression's sizes where the host knows them and ``lengths`` are its ``kept`` (a
        ``keep_topk`` selection), so that padding is cleared only where there is some (``zero_padding``).
        """
        idx = index.clamp(min=0)
        kv = LayerKV(
            keys=self.keys.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, self.keys.shape[-1])),
            values=self.values.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, self.values.shape[-1])),
            positions=self.positions.gather(2, idx),
            lengths=lengths.to(self.lengths),
            state={name: s.gather(2, idx) for name, s in self.state.items()},
            tables=self.tables,
        )
        kv.zero_padding(host)
        return kv

    @classmethod
    def empty(cls, like: "LayerKV", batch: int, capacity: int) -> "LayerKV":
        """``batch`` empty rows (length 0) of ``capacity`` slots with ``like``'s heads, dtypes, state names and
        table sizes, the state packed: the static storage that prefilled rows are placed into (``put_rows``)."""
        H = like.lengths.shape[1]
        kv = cls(keys=like.keys.new_zeros(batch, H, capacity, like.keys.shape[-1]),
                 values=like.values.new_zeros(batch, H, capacity, like.values.shape[-1]),
                 positions=like.positions.new_full((batch, H, capacity), -1),
                 lengths=like.lengths.new_zeros(batch, H),
                 state={name: s.new_zeros(batch, H, capacity) for name, s in like.state.items()},
                 tables={name: t.new_full((batch, H, t.shape[-1]), -1) for name, t in like.tables.items()})
        kv.pack_state()
        return kv

    def row(self, b: int, capacity: int) -> "LayerKV":
        """Batch row ``b`` in its first ``capacity`` slots, as views."""
        return LayerKV(keys=self.keys[b:b + 1, :, :capacity], values=self.values[b:b + 1, :, :capacity],
                       positions=self.positions[b:b + 1, :, :capacity], lengths=self.lengths[b:b + 1],
                       state={name: s[b:b + 1, :, :capacity] for name, s in self.state.items()},
                       tables={name: t[b:b + 1] for name, t in self.tables.items()})

    def take_rows(self, rows: Tensor) -> "LayerKV":
        """A copy of batch rows ``rows`` (n,) (e.g. the rows a decode step compresses while the others wait)."""
        return LayerKV(keys=self.keys[rows], values=self.values[rows], positions=self.positions[rows],
                       lengths=self.lengths[rows], state={name: s[rows] for name, s in self.state.items()},
                       tables={name: t[rows] for name, t in self.tables.items()})

    def put_rows(self, rows: slice | Tensor, kv: "LayerKV", span: int) -> None:
        """Write the first ``span`` slots of ``kv``'s rows into rows ``rows`` (n rows: a slice or indices) of this
        storage, in place (a captured CUDA graph keeps reading the same tensors), and clear the rest of those
        rows. ``kv`` holds n rows, or one row copied into all of them; its tables are padded with unused entries
        to this storage's size. The caller makes room (``span`` <= capacity, tables no larger than these)."""
        if set(kv.state) != set(self.state) or set(kv.tables) != set(self.tables):
            raise ValueError(f"a row with state {sorted(kv.state)} and tables {sorted(kv.tables)} cannot join "
                             f"storage with state {sorted(self.state)} and tables {sorted(self.tables)}")
        pairs = [(self.keys, kv.keys, 0), (self.values, kv.values, 0), (self.positions, kv.positions, -1)]
        pairs += [(self.state[name], s, 0) for name, s in kv.state.items()]
        for mine, theirs, fill in pairs:
            mine[rows, :, :span] = theirs[:, :, :span].to(mine.dtype)
            mine[rows, :, span:] = fill
        self.lengths[rows] = kv.lengths
        for name, table in kv.tables.items():
            mine = self.tables[name]
            mine[rows] = F.pad(table, (0, mine.shape[-1] - table.shape[-1]), value=-1)

    def grow_tables(self, sizes: dict[str, int]) -> None:
        """Re-allocate the tables at ``sizes`` entries (each >= its current size), padded with unused entries."""
        self.tables = {name: F.pad(t, (0, sizes[name] - t.shape[-1]), value=-1) for name, t in self.tables.items()}

    def zero_padding(self, host: HostSizes | None = None) -> None:
        """Clear padding slots so that stale data can never leak into a later computation. ``host``: the sizes
        of the compression that made this storage, its rows at ``HostSizes.kept``; where every head keeps alike
        there is no padding, and nothing is launched (a prompt compression queued on the host while the device
        waits for it: D2O's, after the pass)."""
        if host is not None and host.kept_alike():
            return
        pad = ~self.valid()
        self.keys.masked_fill_(pad.unsqueeze(-1), 0)
        self.values.masked_fill_(pad.unsqueeze(-1), 0)
        self.positions.masked_fill_(pad, -1)
        for s in self.state.values():
            s.masked_fill_(pad, 0)

    def reserve(self, extra: int, exact: bool = False) -> None:
        """Grow the storage so that ``extra`` more slots fit in every row without re-allocation.

        Growth is geometric (at least half the current capacity) unless ``exact``, so a cache that grows one
        token per step is copied O(log n) times, not n times; allocated_bytes() shows the slack. Reads the
        longest row back from the device: the engine's decode path sizes storage from its host mirror instead."""
        need = self.max_length + extra
        if need <= self.capacity:
            return
        self.resize(need if exact else max(need, self.capacity + self.capacity // 2))

    def resize(self, capacity: int) -> None:
        """Re-allocate every per-slot tensor at ``capacity`` slots (>= every row's length), in place; a packed
        state as one block."""
        block = self.packed_state()
        self.keys, self.values = _at_slots(self.keys, capacity, 0, 2), _at_slots(self.values, capacity, 0, 2)
        self.positions = _at_slots(self.positions, capacity, -1, 2)
        if block is None:
            self.state = {name: _at_slots(s, capacity, 0, 2) for name, s in self.state.items()}
        else:
            self.pack_state(_at_slots(block, capacity, 0, 3))

    def placed_alone(self, span: int, capacity: int) -> "LayerKV":
        """What ``empty`` storage of one row at ``capacity`` slots holds once this one-row storage is put into it
        (``put_rows``: its first ``span`` slots, the rest cleared, the state packed): this storage itself, its
        slots past ``span`` cleared, where it can serve (``_adoptable``), else each tensor copied once."""
        block = self.packed_state()
        if capacity == self.capacity and self._adoptable(block):
            for t, fill, dim in ((self.keys, 0, 2), (self.values, 0, 2), (self.positions, -1, 2), (block, 0, 3)):
                t.narrow(dim, span, capacity - span).fill_(fill)
            self.lengths = self.lengths.clone()  # small, and made in the prompt pass's inference mode
            self.tables = {name: t.clone() for name, t in self.tables.items()}
            return self
        kv = LayerKV(keys=self.keys.narrow(2, 0, span), values=self.values.narrow(2, 0, span),
                     positions=self.positions.narrow(2, 0, span), lengths=self.lengths.clone(),
                     state={name: s.narrow(2, 0, span) for name, s in self.state.items()},
                     tables={name: t.clone() for name, t in self.tables.items()})
        kv.pack_state(None if block is None else block.narrow(3, 0, span))
        kv.resize(capacity)
        return kv

    def _adoptable(self, block: Tensor | None) -> bool:
        """Whether this storage's per-slot tensors can be a decode batch's as they are: the state packed
        (``block``), and none a view of another's memory or an inference tensor (decode steps update the storage
        in place, outside inference mode too)."""
        tensors = (self.keys, self.values, self.positions, block)
        return block is not None and all(t._base is None and not t.is_inference() for t in tensors)

    def append(self, keys: Tensor, values: Tensor, positions: Tensor) -> None:
        """Write q new tokens (B, H, q, D) after each row's last real slot, growing the storage if needed."""
        self.reserve(keys.shape[2])
        self.write(keys, values, positions)

    def accumulate_step(self, name: str, stats: AttentionStats) -> None:
        """``accumulate`` of the pass's step attention (``AttentionStats.add_step_to``: made straight into the
        state where it is pending)."""
        if name in self.state:
            stats.add_step_to(self.state[name])
        else:
            self.accumulate(name, stats.step())

    def accumulate(self, name: str, amount: Tensor) -> None:
        """state[name] += amount (B, H, T) in float32, in place (the engine's decode storage and a captured
        CUDA graph hold on to the state tensors); starts the state if the method has none yet."""
        if name in self.state:
            self.state[name].add_(amount)
        else:
            self.state[name] = amount.float().clone()

    def write(self, keys: Tensor, values: Tensor, positions: Tensor) -> None:
        """Write q new tokens (B, H, q, D) after each row's last real slot, in place; positions (B, q).

        The caller guarantees room (``capacity >= max length + q``, known on the host); nothing here reads a
        device value back, so a decode step stays free of host synchronisation. New slots' state starts at 0."""
        block = self.packed_state()
        if block is None:  # states a method replaced start at 0 one by one, the rest goes with an empty block
            slot = self.lengths.unsqueeze(-1) + torch.arange(keys.shape[2], device=keys.device)  # (B, H, q)
            for s in self.state.values():
                s.scatter_(2, slot, 0.0)
            block = self.keys.new_zeros((0, *self.positions.shape), dtype=torch.float32)
        append_slots(keys, values, positions, self.lengths, self.keys, self.values, self.positions, block)

    def write_aligned(self, start: int, keys: Tensor, values: Tensor, positions: Tensor) -> None:
        """``write`` for a cache whose rows all hold ``start`` slots (the host knows it): plain slice copies."""
        B, H, q, _ = keys.shape
        self.keys.narrow(2, start, q).copy_(keys)  # narrow + copy_: the cheapest slice write from Python
        self.values.narrow(2, start, q).copy_(values)
        self.positions.narrow(2, start, q).copy_(positions.view(B, 1, q))
        block = self.packed_state()
        for s in (self.state.values() if block is None else (block,)):
            s.narrow(-1, start, q).zero_()
        self.lengths += q

    def pack_state(self, block: Tensor | None = None) -> None:
        """Make every per-slot state entry a view of one float32 block ``state_block`` (S, B, H, T): ``block``
        where the caller holds the states so (in ``state``'s order), else the states stacked, unless they are
        views of one already; nothing where a state is not float32."""
        names = list(self.state)
        if block is None:
            if self.packed_state() is not None or any(t.dtype != torch.float32 for t in self.state.values()):
                return
            shape = (len(names), *self.positions.shape)
            block = torch.stack([self.state[n] for n in names]) if names else self.keys.new_zeros(
                shape, dtype=torch.float32)
        self.state = {name: block[i] for i, name in enumerate(names)}
        self.state_block = block
        self._state_views = tuple(self.state.values())

    def packed_state(self) -> Tensor | None:
        """``state_block`` if the state entries are still its views (a method may have replaced one), else None."""
        views = self._state_views
        if self.state_block is None or len(views) != len(self.state):
            return None
        return self.state_block if all(t is v for t, v in zip(self.state.values(), views)) else None

    def state_storage(self) -> Tensor:
        """The (S, B, H, T) float32 block every state entry is a view of, packing the states first if they are
        not (the engine's decode storage always is), for the fused decode steps that move every state at once."""
        block = self.packed_state()
        if block is None:
            self.pack_state()
            block = self.packed_state()
        if block is None:
            dtypes = sorted({str(t.dtype) for t in self.state.values()})
            raise ValueError(f"fused decode steps need float32 states; got {dtypes}")
        return block

    def remove_slot(self, victim: Tensor) -> None:
        """Remove slot ``victim`` (B, H) of every row in place: the row's last slot moves into it and the row
        shrinks by one (one slot copied per row instead of a re-gathered cache). Slots are no longer in
        positional order afterwards, and the vacated slot keeps stale data past the length: the engine
        restores order and clears padding before any order-dependent ``Method.compress``."""
        block = self.packed_state()
        if block is None:  # states one by one, then the rest with an empty block
            last = (self.lengths - 1).unsqueeze(-1)
            for t in self.state.values():
                t.scatter_(2, victim.unsqueeze(-1), t.gather(2, last))
            block = self.keys.new_zeros((0, *self.positions.shape), dtype=torch.float32)
        move_last_into(victim, self.lengths, self.keys, self.values, self.positions, block)

    def lowest_slot(self, scores: Tensor, sinks: Tensor, recent: Tensor) -> Tensor:
        """(B, H) each row's lowest-scoring slot outside its first ``sinks`` slots and its ``recent`` newest
        positions ((B, H) each; ties to the oldest position; ``kernels.slots.select_lowest``)."""
        return select_lowest(scores, self.lengths, self.positions, sinks, recent)

    def evict_lowest(self, scores: Tensor, sinks: Tensor, recent: Tensor) -> None:
        """Remove, in place, the slot ``lowest_slot`` picks (in Triton when the state is packed: three launches,
        ``triton_slots.evict_lowest``)."""
        block = self.packed_state()
        if block is None:
            self.remove_slot(self.lowest_slot(scores, sinks, recent))
        else:
            evict_lowest(scores, self.lengths, self.positions, sinks, recent, self.keys, self.values, block)

    def evict_in_budget(self, scores: Tensor | None, n_keep: Tensor, sinks: int, heavy_ratio: float | None) -> None:
        """Remove, in place, the slot each row drops under its budget n_keep (B,) (``kernels.slots.budget_victim``:
        H2O's heavy/recent split of ``scores``, or StreamingLLM's order with ``heavy_ratio=None``); in Triton when
        the state is packed, two or three launches (``triton_slots.evict_in_budget``), the protected counts derived
        from the budget inside them."""
        block = self.packed_state()
        if block is None:
            self.remove_slot(budget_victim(scores, self.lengths, self.positions, n_keep, sinks, heavy_ratio))
        else:
            evict_in_budget(scores, self.lengths, self.positions, n_keep, sinks, heavy_ratio, self.keys, self.values,
                            block)

    def position_order(self) -> Tensor:
        """(B, H, C) slot indices that put each row's real slots in original-token order (after in-place
        removals), padding last."""
        key = torch.where(self.valid(), self.positions, torch.iinfo(self.positions.dtype).max)
        return key.argsort(dim=-1, stable=True)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot's key and value (one head)."""
        return self.keys.shape[-1] * self.keys.element_size() + self.values.shape[-1] * self.values.element_size()

    @property
    def table_bytes(self) -> int:
        """Bytes of one head's tables, every entry (a table has a fixed size)."""
        return sum(t.shape[-1] * t.element_size() for t in self.tables.values())

    def nbytes(self, row: int | None = None) -> int:
        """Bytes of K and V in real slots plus the tables (the logical cache size), of every row or of batch
        row ``row``."""
        lengths = self.lengths if row is None else self.lengths[row]
        return int(lengths.sum()) * self.slot_bytes + lengths.numel() * self.table_bytes

    def allocated_bytes(self) -> int:
        """Bytes of the K and V tensors as allocated (padding included), plus the tables."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, *self.tables.values()))

    @classmethod
    def from_dense(cls, keys: Tensor, values: Tensor, positions: Tensor | None = None) -> "LayerKV":
        """Wrap dense (B, H, T, D) tensors whose rows are all full; positions default to 0..T-1."""
        B, H, T, _ = keys.shape
        if positions is None:
            positions = torch.arange(T, device=keys.device).expand(B, H, T).clone()
        lengths = torch.full((B, H), T, dtype=torch.long, device=keys.device)
        return cls(keys=keys, values=values, positions=positions, lengths=lengths)


@dataclass
class AttentionStats:
    """What the engine measured for one layer during the last forward pass, only what the method declared.

    Attention of query heads is averaged over each GQA group, so every tensor is per key/value head.
    Queries that are padding never contribute. Every (B, H_kv, T) tensor is aligned slot for slot with the
    LayerKV the method receives (T = its capacity; zeros past each row's length).

    column_sums:        (B, H_kv, T) sum over all queries of this pass of their attention to each slot.
    window_column_sums: (B, H_kv, T) the same over the last ``window`` queries of the pass.
    step_attention:     (B, H_kv, T) attention of this pass's queries to each slot: the new token's at a
                        decode step (summed over the queries when a pass feeds several, e.g. a suffix).
    raw_keys:           (B, H_kv, T, D) keys with RoPE removed (for methods that compare raw keys).
    query_column_sums:  (B, H_q, T) column_sums per *query* head (not averaged over the GQA group; query head
                        h reads KV head h // group), for methods whose rule is stated per query head (D2O).
    num_queries:        (B,) number of real queries in this pass.
    one_query:          every row of the pass has one query (a decode step), as the host knows it: a kernel that
                        would read ``num_queries`` to count each slot's observers can count one without it.
    rope:               instead of raw_keys, for the in-place decode step of a method that takes RoPE off the
                        stored keys itself (``Method.unrotates_in_place``): the model's ``attention.Rope``.
    budget_statistic:   (host) ``Method.budget_statistic`` of this layer's prompt statistics, where the engine
                        took it during the pass; ``layer_budgets`` then gets these and ``num_queries`` alone.
    pending_step:       a decode pass's step attention not computed yet: the last launch that makes it, left
                        out of the pass (nothing in the pass reads it) to run where the method observes, on the
                        layer's side stream (``engine.LayerLanes``): ``step`` stores it, ``add_step_to`` adds it
                        into a state. It stays referenced, and with it the buffers it reads (a layer's logits,
                        (B, H_q, T) float32), until the next pass replaces these statistics: the side stream has
                        joined by then, and the allocator may hand them out again. Read the step attention
                        through ``step``.
    """

    column_sums: Tensor | None = None
    window_column_sums: Tensor | None = None
    step_attention: Tensor | None = None
    raw_keys: Tensor | None = None
    query_column_sums: Tensor | None = None
    num_queries: Tensor | None = None
    one_query: bool = False
    rope: Rope | None = None
    budget_statistic: Tensor | None = None
    pending_step: Callable[..., Tensor] | None = None  # (into=None): the step attention, or into += it

    def step(self) -> Tensor | None:
        """The step attention, computed from ``pending_step`` on first use (on the current stream)."""
        if self.step_attention is None and self.pending_step is not None:
            self.step_attention = self.pending_step()
        return self.step_attention

    def add_step_to(self, target: Tensor) -> None:
        """target (B, H_kv, T) float32 += the step attention, in place; a pending one is made straight into it
        (its launch adds instead of storing: no step tensor, and no separate addition reading it back)."""
        if self.step_attention is None and self.pending_step is not None:
            self.pending_step(into=target)
        else:
            target.add_(self.step_attention)

    def take_rows(self, rows: Tensor) -> "AttentionStats":
        """The statistics of batch rows ``rows`` (n,), as ``LayerKV.take_rows`` takes their slots."""
        def take(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[rows.to(t.device)]

        return AttentionStats(column_sums=take(self.column_sums), window_column_sums=take(self.window_column_sums),
                              step_attention=take(self.step()), raw_keys=take(self.raw_keys),
                              query_column_sums=take(self.query_column_sums), num_queries=take(self.num_queries),
                              one_query=self.one_query)

    def broadcast(self, rows: int) -> "AttentionStats":
        """The one-row statistics as ``rows`` identical rows, as views (no copy)."""
        def widen(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.expand(rows, *t.shape[1:])

        return AttentionStats(column_sums=widen(self.column_sums), window_column_sums=widen(self.window_column_sums),
                              step_attention=widen(self.step()), raw_keys=widen(self.raw_keys),
                              query_column_sums=widen(self.query_column_sums), num_queries=widen(self.num_queries),
                              one_query=self.one_query)

    def aligned(self, capacity: int, order: Tensor | None = None) -> "AttentionStats":
        """Reorder slots by ``order`` (B, H, K) (as LayerKV.gather does) and zero-pad to ``capacity``."""
        def fix(t: Tensor | None) -> Tensor | None:
            if t is None:
                return None
            if order is not None:  # per-query-head statistics follow their KV head's order
                rows = order.repeat_interleave(t.shape[1] // order.shape[1], dim=1)
                t = t.gather(2, rows.clamp(min=0, max=t.shape[2] - 1))
            if t.shape[2] < capacity:
                t = torch.cat([t, t.new_zeros(*t.shape[:2], capacity - t.shape[2])], dim=2)
            return t[:, :, :capacity]

        return AttentionStats(column_sums=fix(self.column_sums), window_column_sums=fix(self.window_column_sums),
                              step_attention=fix(self.step()), raw_keys=self.raw_keys,
                              query_column_sums=fix(self.query_column_sums), num_queries=self.num_queries,
                              one_query=self.one_query)


@dataclass
class CentreMembers:
    """Expanded entries that share their stored slot's key direction (EMS "w.o. pos"): member j of the slot c
    attends with the key ||k_j|| * unit(k_c) and the value v_c, so a one-query pass attends to them from the
    stored slots themselves (``kernels.lut_attention.lut_attention_at_centres``), with no view.

    centre: (B, H_kv, E) long, the position of every member's centre (-1: an unused entry); a member whose centre
            is not stored is not attended (``lut_expand.centre_slots``);
    norm: (B, H_kv, E) float32, the member's key norm ||k_j||;
    position_limit: the pass's bound on the positions (``PassPlan.position_limit``), or None.
    """

    centre: Tensor
    norm: Tensor
    position_limit: int | None


@dataclass
class Expansion:
    """What the attention of a pass reads instead of a layer's stored slots (``Method.expand``).

    view:    () -> (kv, slot), the attended entries, built when a pass first reads ``kv`` or ``slot``:
      kv:    left-aligned ragged rows (B, H_kv, C) with their lengths (no state, no tables);
      slot:  (B, H_kv, C) long, the stored slot each entry stands for: the pass's statistics over the entries
             are summed onto it (``fold``), so the method sees them per stored slot as ever.
    members: the same entries as ``CentreMembers`` where they share their slot's key direction, or None: a
             one-query pass then attends without building the view.
    """

    view: Callable[[], tuple[LayerKV, Tensor]]
    members: CentreMembers | None = None

    @cached_property
    def _built(self) -> tuple[LayerKV, Tensor]:
        return self.view()

    @property
    def kv(self) -> LayerKV:
        return self._built[0]

    @property
    def slot(self) -> Tensor:
        return self._built[1]

    def fold(self, stats: dict[str, Tensor], capacity: int) -> dict[str, Tensor]:
        """(B, H, C) statistics of the entries -> (B, H, capacity) of the stored slots; per-query-head ones
        (H_q rows) follow their KV head's slots."""
        return {name: fold_entries(s, self.slot, self.kv.lengths, capacity) for name, s in stats.items()}


# A per-slot state a method may keep: added to the attention logit of the slot for every query (e.g. log of a
# merged slot's multiplicity, so that one centroid weighs like the n tokens it stands for). New slots get 0.
LOGIT_BIAS = "logit_bias"

STAT_NAMES = frozenset({"column_sums", "window_column_sums", "step_attention", "raw_keys", "query_column_sums"})
