"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

Prompt-only compression (methods.md 6.3): every prefix token is scored by the attention it receives from
the observation window, the last ``window`` prompt queries, ``s_j = sum over i in window of A[i, j]``; the
scores are smoothed by 1-D pooling over neighbouring positions; each head keeps its top-k prefix tokens plus
the window itself. Decode tokens are appended uncompressed, so the cache grows while generating [P: EMS].

Settings:
- [P: EMS] ``window`` = 32 (LongBench; 16 for NIAH), ``kernel_size`` = 7. Chelsea uses a 100-token window.
- [std] ``pooling`` = max: the SnapKV paper's experiments use max pooling; its code also offers average
  pooling (``mean`` here). None of the five merging papers states the pooling type.

Interpretations:
- [I] Pooling sees only the prefix of each row: window and padding slots are zeroed before pooling (scores
  are >= 0, so for max pooling this equals SnapKV's pooling of the prefix alone). For mean pooling,
  ``pool1d`` divides the first ``kernel_size // 2`` slots by their in-row neighbour count, where SnapKV's
  ``avg_pool1d`` (zero padding counted) divides by the full kernel; elsewhere they agree.
- [I] A budget smaller than the window keeps the most recent ``n_keep`` tokens (``keep_topk``'s rule).
- [I] Attention of the query heads of a GQA group is averaged (the engine's statistics are per KV head);
  SnapKV scores each query head and repeats KV per query head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvbench.errors import ConfigError
from kvbench.kernels.select import keep_topk, pool1d
from kvbench.kv import AttentionStats, HostSizes, LayerKV
from kvbench.methods.base import Method, per_sample_n_keep
from kvbench.methods.base import check_count

POOLING = ("max", "mean")


@dataclass
class SnapKV(Method):
    """window: observation-window queries (also kept). kernel_size: odd pooling width. pooling: max | mean."""

    name: ClassVar[str] = "snapkv"
    keeps_exact_budget: ClassVar[bool] = True
    needs: ClassVar[frozenset[str]] = frozenset({"window_column_sums"})
    phases: ClassVar[frozenset[str]] = frozenset({"prefill"})

    window: int = 32
    kernel_size: int = 7
    pooling: str = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_count(self.name, 1, window=self.window, kernel_size=self.kernel_size)
        if self.kernel_size % 2 == 0:
            raise ConfigError(f"{self.name}: kernel_size={self.kernel_size} must be odd (same-length pooling)")
        if self.pooling not in POOLING:
            raise ConfigError(f"{self.name}: pooling='{self.pooling}'; accepted: {', '.join(POOLING)}")

    def scores(self, kv: LayerKV, stats: AttentionStats) -> Tensor:
        """(B, H, T) pooled observation-window attention of every prefix slot; 0 on window and padding."""
        votes = stats.window_column_sums.float()  # (B, H, T)
        slots = torch.arange(votes.shape[-1], device=votes.device).view(1, 1, -1)
        prefix = slots < (kv.lengths - self.window).unsqueeze(-1)  # left-aligned rows: prefix = first slots
        return pool1d(votes * prefix, self.kernel_size, self.pooling) * prefix

    def compress(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor, phase: str,
                 host: HostSizes | None = None) -> LayerKV:
        keep = per_sample_n_keep(n_keep, kv)  # (B, H)
        index, lengths = keep_topk(self.scores(kv, stats), keep, kv.lengths, recent=self.window,
                                   row_sizes=host and host.most_kept())
        return kv.gather(index, lengths, host)
