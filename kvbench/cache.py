"""A transformers ``Cache`` whose layers hold ragged per-head compressed storage (``LayerKV``).

The model writes through ``Cache.update`` as usual; the kvbench attention function (``kvbench.attention``)
reads the per-head lengths and positions from here to mask padding, and leaves the statistics the method
asked for in ``pass_stats``. The engine compresses between forward passes.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from kvbench.kv import AttentionStats, LayerKV


class CompressedLayer(CacheLayerMixin):
    """One layer: a ``LayerKV`` plus what the attention function needs about the current pass."""

    is_sliding = False

    def __init__(self) -> None:
        super().__init__()
        self.kv: LayerKV | None = None
        self.fresh = True  # no tokens were cached before the current pass

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        B, H, _, D = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.kv = LayerKV(
            keys=key_states.new_zeros(B, H, 0, D),
            values=value_states.new_zeros(B, H, 0, value_states.shape[-1]),
            positions=torch.zeros(B, H, 0, dtype=torch.long, device=key_states.device),
            lengths=torch.zeros(B, H, dtype=torch.long, device=key_states.device),
        )
        self.is_initialized = True

    def append(self, key_states: Tensor, value_states: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.fresh = self.kv.max_length == 0
        if self.fresh:  # first write: adopt the tensors as they are (no copy)
            B, H, q, _ = key_states.shape
            self.kv = LayerKV(
                keys=key_states,
                values=value_states,
                positions=positions.view(B, 1, q).expand(B, H, q).clone(),
                lengths=torch.full((B, H), q, dtype=torch.long, device=key_states.device),
            )
        else:
            self.kv.append(key_states, value_states, positions)
        t = self.kv.max_length
        self.keys, self.values = self.kv.keys[:, :, :t], self.kv.values[:, :, :t]
        return self.keys, self.values

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        raise RuntimeError("CompressedLayer is written through CompressedCache.update, which knows the positions")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return 0 if self.kv is None else self.kv.max_length

    def get_max_length(self) -> int:
        return -1


class CompressedCache(Cache):
    """Cache of ``num_layers`` compressed layers.

    Before each forward pass the engine sets ``pending_positions`` (B, q): the original index of every input
    token (-1 for padding) and ``wanted_stats``/``window``: what the attention function must measure.
    """

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[CompressedLayer() for _ in range(num_layers)])
        self.pending_positions: Tensor | None = None
        self.wanted_stats: frozenset[str] = frozenset()
        self.window = 0
        self.pass_stats: list[AttentionStats] = [AttentionStats() for _ in range(num_layers)]

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        if self.pending_positions is None:
            raise RuntimeError("CompressedCache: the engine must set pending_positions before a forward pass")
        return self.layers[layer_idx].append(key_states, value_states, self.pending_positions)

    def kv(self, layer_idx: int) -> LayerKV:
        return self.layers[layer_idx].kv

    def set_kv(self, layer_idx: int, kv: LayerKV) -> None:
        layer = self.layers[layer_idx]
        layer.kv = kv
        t = kv.max_length
        layer.keys, layer.values = kv.keys[:, :, :t], kv.values[:, :, :t]

    def drop_padding(self) -> None:
        """Remove slots of padding tokens (position < 0) and left-align every row."""
        for i in range(len(self.layers)):
            kv = self.kv(i)
            real = kv.valid() & (kv.positions >= 0)
            if bool(real.all()):
                continue
            lengths = real.sum(-1)
            # stable order: real slots first, in their original order
            order = (~real).to(torch.int8).argsort(dim=-1, stable=True)[..., : int(lengths.max())]
            self.set_kv(i, kv.gather(order, lengths))
            self.pass_stats[i] = self.pass_stats[i].aligned(int(lengths.max()), order)

    def lengths(self) -> Tensor:
        """(L, B, H) real slots per layer and head."""
        return torch.stack([layer.kv.lengths for layer in self.layers])

    def nbytes(self) -> int:
        return sum(layer.kv.nbytes() for layer in self.layers)

    def allocated_bytes(self) -> int:
        return sum(layer.kv.allocated_bytes() for layer in self.layers)
