"""The one interface every compression method implements.

A method is a pure function of (layer cache, attention statistics, budget, hyperparameters) -> layer cache.
It never sees the model, RoPE, tasks or budget ratios: the engine turns the budget into ``n_keep`` tokens
per sample and layer, calls ``compress`` after prefill (and, for methods that compress while decoding,
every ``decode_interval`` steps once a row exceeds ``n_keep``), and stores whatever comes back.

Capabilities are class data, read by the engine: ``needs`` (statistics the engine must compute),
``phases`` (when the method can compress), ``window`` (queries behind ``window_column_sums``),
``budget_basis`` (what a fractional budget is a fraction of), ``budget_needs`` (statistics
``layer_budgets`` reads, and nothing else: such a method cannot compress a layer before every layer has run, and
once its ``budget_statistic`` has read a layer's, the engine drops them),
``evicts_in_place`` (``evict_one`` implements the one-slot decode step in place), ``keeps_exact_budget`` (a
prompt compression keeps exactly ``min(n_keep, length)`` slots a head, so the engine knows the result's lengths
without reading them back: ``kept_lengths``), ``unrotates_in_place``
(``evict_one`` of a method that needs ``raw_keys`` takes them off the stored keys itself, from ``stats.rope``,
instead of reading ``stats.raw_keys``: the engine then un-RoPEs no copy of the cache), ``expands_slots``
(attention reads ``expand``'s entries instead of the stored slots; a property, since it may depend on the
method's configuration: EMS with its look-up table). The engine asks ``expand`` only of a method that
declares it, so no other method pays anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from kvbench.errors import ConfigError
from kvbench.kv import STAT_NAMES, AttentionStats, Expansion, HostSizes, LayerKV

PHASES = frozenset({"prefill", "decode"})
BUDGET_BASES = ("prompt", "prompt_plus_generation")


@dataclass
class Method:
    """Base class. Subclasses are dataclasses whose fields are the paper's hyperparameters.

    compress_during_decode: keep the cache at ``n_keep`` while generating (only if "decode" in phases).
    decode_interval: compress every this many decode steps (1 = every step, as H2O/EMS/D2O describe).
    """

    name: ClassVar[str] = "base"
    needs: ClassVar[frozenset[str]] = frozenset()
    decode_needs: ClassVar[frozenset[str]] = frozenset()
    phases: ClassVar[frozenset[str]] = frozenset({"prefill"})
    budget_basis: ClassVar[str] = "prompt"
    budget_needs: ClassVar[frozenset[str]] = frozenset()
    evicts_in_place: ClassVar[bool] = False
    unrotates_in_place: ClassVar[bool] = False
    keeps_exact_budget: ClassVar[bool] = False

    compress_during_decode: bool = False
    decode_interval: int = 1

    def __post_init__(self) -> None:
        unknown = (self.needs | self.decode_needs) - STAT_NAMES
        if unknown:
            raise ConfigError(f"{self.name}: unknown statistics {sorted(unknown)}; accepted: {sorted(STAT_NAMES)}")
        if self.compress_during_decode and "decode" not in self.phases:
            raise ConfigError(
                f"{self.name}: compress_during_decode=true but the method only compresses at {sorted(self.phases)}"
            )
        if self.decode_interval < 1:
            raise ConfigError(f"{self.name}: decode_interval={self.decode_interval} must be >= 1")

    # -- what the engine asks -------------------------------------------------------------------------

    @property
    def window(self) -> int:
        """Number of trailing queries behind ``window_column_sums`` (methods with a window override)."""
        return 0

    @property
    def keeps_within_budget(self) -> bool:
        """Whether a row keeps at most its budget after prefill compression (False: its size is data-driven and
        may reach the whole prompt, e.g. KVMerger's thresholds); memory planning before a prefill relies on it."""
        return True

    @property
    def expands_slots(self) -> bool:
        """Whether attention reads ``expand``'s entries instead of the stored slots."""
        return False

    def needed_stats(self, phase: str) -> frozenset[str]:
        if phase == "prefill":
            return self.needs
        return self.decode_needs if self.compress_during_decode else frozenset()

    def hyperparameters(self) -> dict:
        """Every field, for results rows and logs."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def layer_budgets(
        self, n_keep: Tensor, num_layers: int, prefill_stats: list[AttentionStats], max_new_tokens: int
    ) -> Tensor:
        """Split the per-layer budget across layers: (B,) -> (L, B). Default: every layer gets ``n_keep``.

        ``prefill_stats`` are the prompt pass's statistics per layer (``num_queries`` = prompt lengths);
        ``max_new_tokens`` is the generation length the budget was set for.

        Methods with layer-adaptive budgets (PyramidKV, D2O) override this; the total must stay
        ``num_layers * n_keep`` per sample so that budgets compare fairly.
        """
        return n_keep.unsqueeze(0).expand(num_layers, -1).clone()

    def budget_statistic(self, stats: AttentionStats) -> Tensor | None:
        """What ``layer_budgets`` reads of one layer's prompt statistics ``stats`` (a method with ``budget_needs``),
        as a small tensor on their device; None where it reads nothing or needs them whole. The engine takes it
        right after each layer's attention and hands ``layer_budgets`` every layer's on the host
        (``AttentionStats.budget_statistic``), copied behind the last layer's attention: the host then sets the
        budgets and queues the compressions while the device runs the rest of the pass, not after it."""
        return None

    # -- what the method implements ------------------------------------------------------------------

    def compress(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor, phase: str,
                 host: HostSizes | None = None) -> LayerKV:
        """Return the compressed cache of one layer. ``n_keep``: (B,) target slots per head for each sample.

        ``phase`` is "prefill" or "decode". The returned rows must not exceed ``n_keep`` unless the method's
        documented budget rule says otherwise (KVMerger's threshold-driven merging, protected heads).
        ``host``: the sizes ``n_keep`` and ``kv.lengths`` as the host knows them, where the caller does (the
        engine's prompt compressions): a method sizes its kernels from them instead of reading sizes back from
        the device. The result is the same with or without them.
        """
        raise NotImplementedError

    def kept_lengths(self, layer: int, host: HostSizes) -> np.ndarray | None:
        """(B, H) the row lengths ``compress(layer, kv, stats, n_keep, "prefill", host)`` returns, known on the host
        from the sizes alone (no read back), or None where the data decide them (the engine then reads them).
        ``min(budget, length)`` where the method ``keeps_exact_budget``; a method with another rule overrides."""
        return host.kept() if self.keeps_exact_budget else None

    def batch_row(self, out: LayerKV, b: int, capacity: int, host: HostSizes) -> LayerKV:
        """Row ``b``, in its first ``capacity`` slots (views), of ``out = compress(layer, kv, stats, n_keep,
        "prefill", host)`` over several rows: what ``compress`` of that row alone gives. A method whose tables one
        call sizes for the call's largest budget cuts them to the row's own."""
        return out.row(b, capacity)

    def evict_one(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor) -> None:
        """The decode step of a method that compresses every step, in place: every row holds n_keep + 1 slots
        (in any order; positions say which token each slot holds). Merge whatever the method merges into
        slots that stay and drop one slot per row (``LayerKV.evict_lowest``, or ``LayerKV.remove_slot`` of a
        slot found with ``LayerKV.lowest_slot``; whatever depends on positions, such as "the next slots",
        from ``kv.positions``, e.g. ``kernels.slots.next_slots``; the merging methods' fused steps are
        ``kernels.*_step``), writing ``kv`` in place. Must give the same cache, up to slot order, as
        ``compress`` (tests compare the two), and must not read device values back (it runs inside CUDA
        graphs): fixed-shape operations only."""
        raise NotImplementedError

    def expand(self, layer: int, kv: LayerKV, rotate: Callable[[Tensor, Tensor], Tensor],
               position_limit: int | None = None) -> Expansion | None:
        """The entries every pass over layer ``layer``'s stored cache ``kv`` attends instead of its slots (asked
        only when ``expands_slots``), or None for the slots themselves. ``rotate(keys, offsets)`` rotates
        post-RoPE keys (B, H, E, D) by the model's RoPE at ``offsets`` (B, H, E), of any sign;
        ``position_limit``: the pass's ``PassPlan.position_limit`` (None: not known). Statistics the
        method asked for come back per stored slot, summed over the entries that stand for it. Must keep
        static shapes and read no device value back (it runs inside decode steps and CUDA graphs)."""
        raise NotImplementedError

    def observe(self, layer: int, kv: LayerKV, stats: AttentionStats) -> None:
        """Called after every decode step on every layer, before any compression: update per-slot state
        in place (e.g. H2O accumulates the new query's attention). Default: nothing."""

    def observe_and_evict_one(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor) -> None:
        """``observe`` then ``evict_one``: what the engine calls on a one-token step that evicts in place. A method
        may do the two in fewer launches (D2O makes the pending step attention inside its eviction's first one);
        the cache must come out as from the two calls."""
        self.observe(layer, kv, stats)
        self.evict_one(layer, kv, stats, n_keep)


def check_positive(method: str, **values: float) -> None:
    """Raise a ConfigError naming every value that is not > 0."""
    for key, value in values.items():
        if not value > 0:
            raise ConfigError(f"{method}: {key}={value} must be > 0")


def check_unit_interval(method: str, **values: float) -> None:
    """Raise a ConfigError naming every value outside [0, 1]."""
    for key, value in values.items():
        if not 0 <= value <= 1:
            raise ConfigError(f"{method}: {key}={value} must be in [0, 1]")


def per_sample_n_keep(n_keep: Tensor, kv: LayerKV) -> Tensor:
    """(B,) budget -> (B, H) clamped to each row's length (a row shorter than the budget keeps everything)."""
    return torch.minimum(n_keep.to(kv.lengths).unsqueeze(-1).expand_as(kv.lengths), kv.lengths)


def prompt_observers(kv: LayerKV) -> Tensor:
    """(B, H, T) float: how many prompt queries could attend each slot of a just-prefilled (left-aligned,
    uncompressed) cache: ``length - slot`` (causal attention), 0 on padding."""
    slots = torch.arange(kv.capacity, device=kv.keys.device).view(1, 1, -1)
    return (kv.lengths.unsqueeze(-1) - slots).clamp(min=0).float()


def check_count(method: str, minimum: int, **values) -> None:
    """Raise a ConfigError naming every value that is not an integer >= ``minimum``."""
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{method}: {key}={value!r} must be an integer >= {minimum}")
