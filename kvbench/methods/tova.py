"""TOVA, Token Omission Via Attention (Oren et al., 2024, "Transformers are Multi-State RNNs").

At every decode step, evict the token that receives the lowest attention from the current query; no
accumulation over steps (methods.md 6.6; "identifies the token with the lowest attention score from the
previous step as the least important" [P: WeightedKV]).

Interpretations:
- [std] Scores are averaged over the heads of the layer (``head_average: true``), so all heads of a layer
  keep the same tokens; ``head_average: false`` scores every KV head by its own attention.
- [std] A prompt longer than the budget is cut once after prefill, by the attention of the last prompt
  query (``window_column_sums`` with a window of 1), then one token is evicted per decode step.
- [I] The attention of the query heads of a GQA group is first averaged per KV head (the engine's
  statistics); the head average of those equals the average over all query heads (equal group sizes).
- [I] The newest token is scored like every other (its attention to itself), never protected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvbench.errors import ConfigError
from kvbench.kernels.select import keep_topk
from kvbench.kv import AttentionStats, HostSizes, LayerKV
from kvbench.methods.base import Method, per_sample_n_keep


@dataclass
class TOVA(Method):
    """head_average: one score per token for the whole layer (mean over heads) instead of one per head."""

    name: ClassVar[str] = "tova"
    keeps_exact_budget: ClassVar[bool] = True
    needs: ClassVar[frozenset[str]] = frozenset({"window_column_sums"})
    decode_needs: ClassVar[frozenset[str]] = frozenset({"step_attention"})
    phases: ClassVar[frozenset[str]] = frozenset({"prefill", "decode"})
    evicts_in_place: ClassVar[bool] = True

    head_average: bool = True
    compress_during_decode: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.head_average, bool):
            raise ConfigError(f"{self.name}: head_average={self.head_average!r}; accepted: true, false")

    @property
    def window(self) -> int:
        """The prefill score is the attention of the last prompt query only."""
        return 1

    def compress(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor, phase: str,
                 host: HostSizes | None = None) -> LayerKV:
        scores = self.scores(stats.window_column_sums if phase == "prefill" else stats.step())
        index, lengths = keep_topk(scores, per_sample_n_keep(n_keep, kv), kv.lengths,
                                   row_sizes=host and host.most_kept())
        return kv.gather(index, lengths, host)

    def scores(self, attention: Tensor) -> Tensor:
        """(B, H, T) attention -> eviction scores (the head average, or each head's own)."""
        if not self.head_average:
            return attention
        # Heads of a row hold the same tokens in the same slots: they always drop the same slot, in place too.
        return attention.mean(dim=1, keepdim=True).expand_as(attention)

    def evict_one(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor) -> None:
        """The slot the current query attends to least (nothing protected)."""
        none = torch.zeros_like(kv.lengths)
        kv.evict_lowest(self.scores(stats.step()), none, none)
