"""PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling").

Layer-wise pyramidal budgets (more cache in lower layers, less in higher ones; methods.md 6.4, "layer-wise KV
eviction" [P: D2O]) with SnapKV selection inside every layer [std]: the scoring and selection are SnapKV's,
only ``layer_budgets`` differs.

Budget schedule [std, from the PyramidKV paper and code; not in the five merging papers]: with ``m`` layers
and mean budget ``k`` (here ``n_keep``), the top layer gets ``k / beta`` and the bottom layer ``2k - k/beta``,
layers in between on a straight line, so the mean stays ``k``. ``beta`` therefore sets the top/bottom ratio
(bottom/top = 2*beta - 1); PyramidKV's code uses beta = 20.

Interpretations:
- [std] As in PyramidKV's code, the schedule applies to the budget beyond the observation window and every
  layer also keeps its window, so each layer gets at least ``window`` slots.
- [std] As in PyramidKV's code, a bottom layer that would exceed the prompt is capped at the prompt length
  and the top layer takes the difference, so the total stays the same.
- [I, from PyramidKV's code] When the prompt is shorter than twice the budget beyond the window
  (``q_len < 2 * (n_keep - window)``), the code gives up the pyramid and every layer keeps ``n_keep`` (plain
  SnapKV); so does kvbench. This is the code's rule, not the paper's prose.
- [I] Budgets are rounded to integers by largest remainder (ties to lower layers): the total over layers is
  exactly ``L * n_keep`` per sample and budgets never increase with depth.
- [I] A budget of at most ``window`` leaves no room for a pyramid, and one covering the whole prompt has
  nothing to compress: in both cases every layer gets ``n_keep``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvbench.errors import ConfigError
from kvbench.kv import AttentionStats
from kvbench.methods.snapkv import SnapKV


@dataclass
class PyramidKV(SnapKV):
    """SnapKV's window/kernel_size/pooling plus beta: the top layer keeps 1/beta of the mean spare budget."""

    name: ClassVar[str] = "pyramidkv"

    beta: float = 20.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or not self.beta >= 1:
            raise ConfigError(f"{self.name}: beta={self.beta!r} must be a number >= 1 (1 = equal budgets)")

    def layer_budgets(
        self, n_keep: Tensor, num_layers: int, prefill_stats: list[AttentionStats], max_new_tokens: int
    ) -> Tensor:
        """(B,) mean budget -> (L, B) integer budgets, decreasing with depth, summing to L * n_keep."""
        if num_layers == 1:
            return n_keep.view(1, -1).clone()
        spare = (n_keep - self.window).double()  # (B,) budget beyond the window
        top = spare / self.beta
        bottom = 2 * spare - top
        pyramid = spare > 0
        prompt = prefill_stats[0].num_queries if prefill_stats else None
        if prompt is not None:
            prompt = prompt.to(spare)
            capped = bottom + self.window > prompt
            bottom = torch.where(capped, prompt - self.window, bottom)
            top = torch.where(capped, 2 * spare - bottom, top)
            pyramid &= n_keep.to(prompt) < prompt  # a budget covering the prompt keeps every layer whole
            pyramid &= prompt >= 2 * spare  # the code's fallback to uniform budgets
        depth = torch.linspace(0, 1, num_layers, dtype=torch.float64, device=spare.device).view(-1, 1)  # (L, 1)
        budgets = self.window + bottom + (top - bottom) * depth  # (L, B)
        budgets = torch.where(pyramid, budgets, n_keep.to(budgets))
        return round_to_total(budgets, n_keep * num_layers).to(n_keep)


def round_to_total(values: Tensor, total: Tensor) -> Tensor:
    """Integer (L, B) near ``values`` whose column sums equal ``total`` (B,): floor, then give the missing
    units to the largest fractional parts, ties to the lower row (a non-increasing column stays so)."""
    floors = values.floor()
    missing = (total.to(values) - floors.sum(0)).round().long()  # (B,)
    order = (floors - values).argsort(dim=0, stable=True)  # largest fraction first
    ranks = torch.arange(len(values), device=values.device).view(-1, 1).expand_as(order)
    rank = torch.empty_like(order).scatter_(0, order, ranks)  # rank[layer, b] of each layer's fraction
    return floors.long() + (rank < missing.view(1, -1)).long()
