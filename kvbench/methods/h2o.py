"""H2O, Heavy-Hitter Oracle (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative
Inference of Large Language Models").

Score of a token: its accumulated attention ``a_j = sum over queries i so far of A[i, j]`` (methods.md 6.1;
KVMerger, EMS and D2O describe it so). Keep the heavy hitters (top ``a_j``) plus a recent window and evict
the rest, after the prompt and at every decode step, one eviction per new token [std; EMS].

Score convention, ``normalize``:
- ``sum`` (default): the accumulated attention itself. This is what the H2O paper uses (its greedy
  eviction ranks tokens by the sum of the attention they received; its code sums the prompt attention over
  queries and adds each decode query's) and what KVMerger, EMS and D2O describe.
- ``mean_over_observers``: the accumulated attention divided by the number of queries that could see the
  token (prompt: ``length - slot`` causal queries; each later pass adds its queries, q for a pass of q
  tokens, state "observations"). Another common implementation (NVIDIA kvpress's ObservedAttentionPress)
  scores so, averages over the GQA group as here, keeps no recent window and compresses the prompt only:
  ``normalize=mean_over_observers heavy_ratio=1 compress_during_decode=false`` reproduces it. It removes the
  causal advantage of early tokens (a token near the end of the prompt is seen by few queries).

Interpretations:
- [std] Split of the per-head budget: ``heavy_ratio`` = 0.5 heavy hitters, the rest recent tokens.
  D2O's own H2O variant uses 3:1 plus sinks (heavy_ratio=0.75, sinks=4).
- [I] ``heavy = floor(heavy_ratio * n_keep)``, ``recent = n_keep - heavy`` (the rounding remainder goes to
  the recent window, as in H2O's code, which floors each share).
- [I] Optional ``sinks`` (default 0, as in H2O) are protected and come out of the heavy share.
- [std] Prompt scores are the column sums over all prompt queries; each decode step adds the new query's
  attention (``observe``). The score lives in the per-slot state "score", so it moves with its slot.
- [I] Attention of the query heads of a GQA group is averaged (the engine's statistics are per KV head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from kvbench.errors import ConfigError
from kvbench.kernels.observe import pass_observers
from kvbench.kernels.select import heavy_split, keep_topk
from kvbench.kv import AttentionStats, HostSizes, LayerKV
from kvbench.methods.base import Method, check_count, check_unit_interval, per_sample_n_keep, prompt_observers

SCORE = "score"  # accumulated attention
OBSERVED = "observations"  # queries that could see the slot (normalize="mean_over_observers" only)
NORMALIZATIONS = ("sum", "mean_over_observers")


@dataclass
class H2O(Method):
    """heavy_ratio: share of the budget for heavy hitters (the rest: recent window). sinks: protected first tokens.
    normalize: score = accumulated attention ("sum", the paper) or its mean over the queries that saw the token."""

    name: ClassVar[str] = "h2o"
    keeps_exact_budget: ClassVar[bool] = True
    needs: ClassVar[frozenset[str]] = frozenset({"column_sums"})
    decode_needs: ClassVar[frozenset[str]] = frozenset({"step_attention"})
    phases: ClassVar[frozenset[str]] = frozenset({"prefill", "decode"})
    evicts_in_place: ClassVar[bool] = True

    heavy_ratio: float = 0.5
    sinks: int = 0
    normalize: str = "sum"
    compress_during_decode: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_unit_interval(self.name, heavy_ratio=self.heavy_ratio)
        check_count(self.name, 0, sinks=self.sinks)
        if self.normalize not in NORMALIZATIONS:
            raise ConfigError(
                f"{self.name}: unknown normalize '{self.normalize}'; accepted: {', '.join(NORMALIZATIONS)}")

    def observe(self, layer: int, kv: LayerKV, stats: AttentionStats) -> None:
        """Accumulate the newest query's attention into the per-slot score (and count its observers)."""
        kv.accumulate_step(SCORE, stats)  # summed over the pass's queries
        if self.normalize == "mean_over_observers":
            kv.accumulate(OBSERVED, pass_observers(kv.positions, kv.lengths, stats.num_queries))

    def compress(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor, phase: str,
                 host: HostSizes | None = None) -> LayerKV:
        if phase == "prefill":
            kv.state[SCORE] = stats.column_sums.float().clone()
            if self.normalize == "mean_over_observers":
                kv.state[OBSERVED] = prompt_observers(kv)
        keep = per_sample_n_keep(n_keep, kv)  # (B, H)
        sinks, recent = heavy_split(keep, self.heavy_ratio, self.sinks)
        index, lengths = keep_topk(self._score(kv), keep, kv.lengths, sinks=sinks, recent=recent,
                                   row_sizes=host and host.most_kept())
        return kv.gather(index, lengths, host)

    def evict_one(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor) -> None:
        """The lowest score outside the sinks and the recent window (the budget's split made on the device)."""
        kv.evict_in_budget(self._score(kv), n_keep, self.sinks, self.heavy_ratio)

    def _score(self, kv: LayerKV) -> Tensor:
        """(B, H, T) the score ``normalize`` names."""
        if self.normalize == "mean_over_observers":
            return kv.state[SCORE] / kv.state[OBSERVED].clamp(min=1)
        return kv.state[SCORE]

