"""A transformers ``Cache`` whose layers hold ragged per-head compressed storage (``LayerKV``).

The model writes through ``Cache.update`` as usual; the kvbench attention function (``kvbench.attention``)
reads the layer's storage from here, and leaves the statistics the method asked for in ``pass_stats``.

Storage has a fixed capacity per layer (allocated once per batch, for the budget plus the slots decoding adds
before the next compression), new tokens are written in place, and the host keeps a mirror of every row's
length (``host_lengths``): every shape decision of a decode step (capacity, longest row, whether all rows are
aligned) is made on the host from the mirror, so a decode step never waits for the device. The mirror is
updated arithmetically on every write and in-place removal, and read back from the device once per
compression call that can change lengths in a data-dependent way.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from kvbench.kv import AttentionStats, Expansion, LayerKV


def row_index(rows: np.ndarray, device: torch.device) -> slice | Tensor:
    """Batch rows ``rows`` (n,) as an index into a storage on ``device``: a slice where they are consecutive
    (as a point's slots mostly are), else a device tensor. A slice indexes without copying an index to the
    device, a copy from pageable memory that waits for all the work queued on the device before it."""
    if len(rows) and (np.diff(rows) == 1).all():
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return torch.as_tensor(rows, device=device)


@dataclass
class PassPlan:
    """What the engine asks of one forward pass, set on the cache before the pass.

    query_positions: (B, q) original index of every input token.
    num_queries:     (B,) real queries of the pass (every token: kvbench's passes carry no padding).
    wanted:          statistics the method declared for this pass (``kvbench.kv.STAT_NAMES``).
    window:          queries behind ``window_column_sums``.
    after_layer:     called with the layer index right after its attention (per-layer prompt compression).
    static_shapes:   no host-known length may shape a kernel (a CUDA graph is being captured).
    expand:          (layer index, stored cache, position_limit=) -> the entries attention reads instead of the
                     stored slots, or None for the slots themselves (``Method.expand``); None for methods that
                     never expand.
    position_limit:  a bound, known on the host, that every position stored or fed in the pass is below; None
                     where the caller has none (``Session.position_limit``).
    stat_sets:       a prompt pass shared by several methods (``kvbench.shared_prefill``): further (wanted,
                     window) statistic sets, each computed as a pass asking for it alone computes it; they land
                     in ``CompressedCache.set_stats``, in this order.
    """

    query_positions: Tensor
    num_queries: Tensor
    wanted: frozenset[str] = frozenset()
    window: int = 0
    after_layer: Callable[[int], None] | None = None
    static_shapes: bool = False
    expand: Callable[[int, LayerKV, int | None], Expansion | None] | None = None
    position_limit: int | None = None
    stat_sets: tuple[tuple[frozenset[str], int], ...] = ()


class CompressedLayer(CacheLayerMixin):
    """One layer: a ``LayerKV`` plus the host mirror of its row lengths."""

    is_sliding = False

    def __init__(self) -> None:
        super().__init__()
        self.kv: LayerKV | None = None
        self.host_lengths: np.ndarray | None = None  # (B, H) int64, equal to kv.lengths at all times
        self.longest = 0  # the longest row (host)
        self.aligned: int | None = None  # the length every row has, None when rows differ (host)
        self.fresh = True  # the current pass is the first over this layer (its prompt pass)
        self.ordered = True  # real slots are in original-token order (in-place removals break it)
        self.storage_version = 0  # bumped whenever the storage tensors are replaced (graphs re-capture)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def adopt(self, kv: LayerKV, host_lengths: np.ndarray | None = None) -> None:
        """Install ``kv`` as this layer's storage; ``host_lengths`` if the caller knows them (else one read). The
        mirror is a copy of its own (writes update it in place)."""
        self.kv = kv
        self._mirror((kv.lengths.cpu().numpy() if host_lengths is None else host_lengths).astype(np.int64))
        self.ordered = True
        self.storage_version += 1

    def store(self, kv: LayerKV) -> None:
        """Install a compressed cache during decoding: copied into the existing storage when it fits (a
        captured CUDA graph keeps reading the same tensors), else adopted."""
        old = self.kv
        tables = {name: t.shape for name, t in kv.tables.items()}
        if kv.capacity > old.capacity or set(kv.state) != set(old.state) or tables != {
                name: t.shape for name, t in old.tables.items()}:
            kv.pack_state()
            self.adopt(kv)
            return
        t = kv.capacity
        for mine, theirs in ((old.keys, kv.keys), (old.values, kv.values), (old.positions, kv.positions),
                             *((old.state[name], s) for name, s in kv.state.items())):
            mine[:, :, :t] = theirs
        for name, table in kv.tables.items():
            old.tables[name].copy_(table)
        old.lengths.copy_(kv.lengths)
        old.zero_padding()
        self._mirror(kv.lengths.cpu().numpy().copy())
        self.ordered = True

    def allocate(self, like: "CompressedLayer", batch: int, capacity: int) -> None:
        """Empty static storage of ``batch`` rows at ``capacity`` slots, shaped like the prefilled row ``like``."""
        self.lazy_initialization(like.kv.keys, like.kv.values)
        self.adopt(LayerKV.empty(like.kv, batch, capacity), np.zeros((batch, like.host_lengths.shape[1]), np.int64))
        self.fresh = False

    def allocate_alone(self, row: "CompressedLayer", capacity: int) -> None:
        """``allocate`` storage of one row at ``capacity`` slots and ``place`` the one-row layer ``row`` into it, in
        fewer operations (``LayerKV.placed_alone``: the row's own storage where it fits, else a copy a tensor)."""
        self.lazy_initialization(row.kv.keys, row.kv.values)
        self.adopt(row.kv.placed_alone(row.longest, capacity), row.host_lengths)
        self.ordered = row.ordered
        self.fresh = False

    def place(self, rows: np.ndarray, row: "CompressedLayer", capacity: int) -> None:
        """Copy the one-row layer ``row`` into rows ``rows`` of this storage, first growing the storage to at
        least ``capacity`` slots (what the row needs while it decodes) and its tables to the row's sizes."""
        self._make_room(capacity, row.kv)
        self.kv.put_rows(row_index(rows, self.kv.keys.device), row.kv, row.longest)
        self._set_rows(rows, row.host_lengths)
        self.ordered = self.ordered and row.ordered

    def store_rows(self, rows: np.ndarray, kv: LayerKV) -> None:
        """``store`` for some rows: a compressed cache of rows ``rows`` written back into their storage rows."""
        self._make_room(kv.capacity, kv)
        self.kv.put_rows(row_index(rows, self.kv.keys.device), kv, kv.capacity)
        self._set_rows(rows, kv.lengths.cpu().numpy())

    def clear_rows(self, rows: np.ndarray) -> None:
        """Empty rows ``rows`` (length 0): a finished row that keeps stepping until a new row takes its slot."""
        self.kv.lengths[row_index(rows, self.kv.keys.device)] = 0
        self._set_rows(rows, 0)

    def _make_room(self, capacity: int, kv: LayerKV) -> None:
        if capacity > self.kv.capacity:
            self.grow(capacity)
        sizes = {name: max(t.shape[-1], kv.tables[name].shape[-1]) for name, t in self.kv.tables.items()
                 if name in kv.tables}
        if any(self.kv.tables[name].shape[-1] < size for name, size in sizes.items()):
            self.kv.grow_tables(sizes)
            self.storage_version += 1

    def _set_rows(self, rows: np.ndarray, host_lengths: np.ndarray | int) -> None:
        mirror = self.host_lengths.copy()
        mirror[rows] = host_lengths
        self._mirror(mirror)

    def _mirror(self, host_lengths: np.ndarray) -> None:
        """Set the host mirror, with the two facts every pass asks: the longest row, and the common length
        of all rows (None when they differ). Writes and removals update them arithmetically."""
        self.host_lengths = host_lengths
        self.longest = int(host_lengths.max()) if host_lengths.size else 0
        first = int(host_lengths.flat[0]) if host_lengths.size else 0
        self.aligned = first if bool((host_lengths == first).all()) else None

    def write(self, key_states: Tensor, value_states: Tensor, positions: Tensor, static_shapes: bool) -> None:
        """Write the pass's q new tokens. The first pass adopts the tensors as they are (no copy)."""
        self.fresh = self.kv is None
        B, H, q, _ = key_states.shape
        if self.fresh:
            self.kv = LayerKV(keys=key_states, values=value_states,
                              positions=positions.view(B, 1, q).expand(B, H, q).clone(),
                              lengths=torch.full((B, H), q, dtype=torch.long, device=key_states.device))
            self._mirror(np.full((B, H), q, dtype=np.int64))
            return
        if self.longest + q > self.kv.capacity:
            self.grow(self.longest + q)
        if self.aligned is not None and not static_shapes:
            self.kv.write_aligned(self.aligned, key_states, value_states, positions)
        else:
            self.kv.write(key_states, value_states, positions)
        self.shift(q)

    def shift(self, q: int) -> None:
        """Mirror of every row growing (or, q < 0, shrinking) by q slots."""
        self.host_lengths += q
        self.longest += q
        if self.aligned is not None:
            self.aligned += q

    def grow(self, capacity: int) -> None:
        """Re-allocate at ``capacity`` slots (geometric, so a cache that outgrows its plan is copied rarely)."""
        self.kv.resize(max(capacity, self.kv.capacity + self.kv.capacity // 2))
        self.kv.pack_state()
        self.storage_version += 1

    def removed_one(self) -> None:
        """Mirror of ``LayerKV.remove_slot``: every row lost one slot."""
        self.shift(-1)
        self.ordered = False

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        raise RuntimeError("CompressedLayer is written through CompressedCache.update, which knows the positions")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return 0 if self.kv is None else self.longest

    def get_max_length(self) -> int:
        return -1


class CompressedCache(Cache):
    """Cache of ``num_layers`` compressed layers. Before each forward pass the engine sets ``plan``."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[CompressedLayer() for _ in range(num_layers)])
        self.plan: PassPlan | None = None
        self.pass_stats: list[AttentionStats] = [AttentionStats() for _ in range(num_layers)]
        self.set_stats: list[list[AttentionStats]] = [[] for _ in range(num_layers)]  # PassPlan.stat_sets'

    @torch.compiler.disable  # host decisions (the length mirror): compiled layers call it as it is
    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        if self.plan is None:
            raise RuntimeError("CompressedCache: the engine must set a PassPlan before a forward pass")
        layer = self.layers[layer_idx]
        layer.write(key_states, value_states, self.plan.query_positions, self.plan.static_shapes)
        return layer.kv.keys, layer.kv.values

    def kv(self, layer_idx: int) -> LayerKV:
        return self.layers[layer_idx].kv

    def set_kv(self, layer_idx: int, kv: LayerKV, host_lengths: np.ndarray | None = None) -> None:
        """Install a method's compressed cache (a functional ``compress`` result) as the layer's storage;
        ``host_lengths`` if the caller knows them already (read back, or ``Method.kept_lengths``)."""
        self.layers[layer_idx].adopt(kv, host_lengths)

    def lengths(self) -> Tensor:
        """(L, B, H) real slots per layer and head (from the host mirror: no device read)."""
        return torch.from_numpy(np.stack([layer.host_lengths for layer in self.layers]))

    def row_bytes(self) -> np.ndarray:
        """(B,) K+V bytes of every row's real slots and its tables, all layers (host mirror)."""
        return sum(layer.host_lengths.sum(-1) * layer.kv.slot_bytes + layer.host_lengths.shape[-1] *
                   layer.kv.table_bytes for layer in self.layers)

    def nbytes(self) -> int:
        return sum(layer.kv.nbytes() for layer in self.layers)

    def allocated_bytes(self) -> int:
        return sum(layer.kv.allocated_bytes() for layer in self.layers)


class PartitionedLayer(CacheLayerMixin):
    """One layer of a ``CompositeCache``: what transformers asks of a layer, answered over every point's rows."""

    is_sliding = False

    def __init__(self, parts: list[CompressedLayer]) -> None:
        super().__init__()
        self.parts = parts
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        pass

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        raise RuntimeError("PartitionedLayer is written through CompositeCache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return max(part.get_seq_length() for part in self.parts)

    def get_max_length(self) -> int:
        return -1


class CompositeCache(Cache):
    """The rows of several points (each a method, budget and storage) in one forward pass, so that the weights
    are read once for all of them: rows ``[start, start + n)`` of the batch belong to one point's
    ``CompressedCache``, whose ``plan`` the engine sets before the pass. The model writes through ``update``,
    which hands each point its rows; the kvbench attention function attends each point's rows over that point's
    storage (``kvbench.attention``)."""

    def __init__(self, parts: list[CompressedCache]) -> None:
        super().__init__(layers=[PartitionedLayer([part.layers[i] for part in parts])
                                 for i in range(len(parts[0].layers))])
        self.plan: PassPlan | None = None  # unused: every point's cache carries its own
        self.partitions: list[tuple[int, int, CompressedCache]] = []  # (first row, rows, cache) in batch order
        start = 0
        for part in parts:
            rows = part.layers[0].host_lengths.shape[0]
            self.partitions.append((start, rows, part))
            start += rows

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        for start, rows, part in self.partitions:
            part.update(key_states.narrow(0, start, rows), value_states.narrow(0, start, rows), layer_idx)
        return key_states, value_states
