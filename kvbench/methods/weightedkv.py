"""WeightedKV (Yuan, He, Bai, Leng, Jiang, "WeightedKV: Attention Scores Weighted Key-Value Cache Merging for
LLMs"). methods.md §4.

Per KV head, two running statistics per slot: a = accumulated attention and n = number of queries that saw
the slot (prompt: column sums and the number of prompt queries at or after the slot; every decode step adds
the new query's attention to a and 1 to n, ``observe``). Whenever a row holds more than its budget m:
    a_bar = a / n                                          # historical average attention score
    j     = argmin a_bar over the mergeable region         # excludes the sinks and the recent window
    v[r]  = (a_bar[j] v[j] + a_bar[r] v[r]) / (a_bar[j] + a_bar[r]),  r = j's right neighbour
    drop k[j], v[j], a[j], n[j]                            # r keeps its own key, a and n  [P Algorithm 1]
Paper toy example (Fig. 3): scores 0.1 and 0.5 give v2 / 6 + 5 v3 / 6.

Interpretations:
- [I] Mergeable region = slots [sinks, len - recent) (the paper protects 4 sinks and a recent window in its
  experiments; Algorithm 1's argmin runs over the first m slots, i.e. it never merges the newest token away,
  so at least 1 recent slot is always protected). The right neighbour of the last region slot is the first
  recent slot, and merging into it is allowed (Algorithm 1 restricts only j).
- [I] ``recent=None`` derives the paper's window from the budget: sinks + recent = m / 2 (508 for m = 1024,
  124 for m = 256). Sinks + recent never exceed m - 1 in a row, so a region to merge from always remains.
- [I] Prefill with m below the prompt length applies the same rule repeatedly until len = m. Scores do not
  change while merging (no new queries), so the order of the merges is known up front: ascending a_bar,
  ties to the earlier slot, exactly the sequence of argmins. The merges themselves run in a loop of
  (len - m) steps, each O(d) per row and vectorised over batch and heads; a deleted slot merges into the
  nearest *surviving* slot on its right (a linked list of survivors), as the sequential rule does.
- [I] A slot never observed (n = 0, e.g. a suffix fed without statistics) has no average yet: it is merged
  only after every observed slot of the region.
- [I] Weights with a_bar[j] + a_bar[r] = 0 fall back to 1/2 each.
- [I] GQA: the engine averages the attention of the query heads of each KV group.

Cost: prefill O((T - m) * (d + 1)) work in T - m sequential steps per layer (plus one sort O(T log T));
decode, one merge per step: O(T) for the argmin and O(d) for the merge, 2 scalars of state per slot. Each
merge touches two slots only, so the pairwise convex combination is applied directly rather than through
``scatter_merge`` (a full-row scatter per merge would cost O(T d)).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import Tensor

from kvbench.kernels.select import keep_topk
from kvbench.kv import AttentionStats, LayerKV
from kvbench.methods.base import Method, per_sample_n_keep
from kvbench.methods.base import check_count

ACCUMULATED = "accumulated_attention"  # a
OBSERVED = "observations"  # n


@dataclass
class WeightedKV(Method):
    """sinks: first tokens never merged (paper 4). recent: newest tokens never merged (paper 508 / 124 for
    m = 1024 / 256; None = m / 2 - sinks, the paper's proportion)."""

    name: ClassVar[str] = "weightedkv"
    needs: ClassVar[frozenset[str]] = frozenset({"column_sums"})
    decode_needs: ClassVar[frozenset[str]] = frozenset({"step_attention"})
    phases: ClassVar[frozenset[str]] = frozenset({"prefill", "decode"})

    sinks: int = 4
    recent: int | None = None
    compress_during_decode: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_count(self.name, 0, sinks=self.sinks)
        if self.recent is not None:
            check_count(self.name, 0, recent=self.recent)

    def observe(self, layer: int, kv: LayerKV, stats: AttentionStats) -> None:
        """a += attention of the newest query; n += 1 on every real slot."""
        kv.accumulate(ACCUMULATED, stats.step_attention)
        kv.accumulate(OBSERVED, kv.valid())

    def compress(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor, phase: str) -> LayerKV:
        if phase == "prefill":
            slots = torch.arange(kv.capacity, device=kv.keys.device).view(1, 1, -1)
            kv.state[ACCUMULATED] = stats.column_sums.float().clone()
            kv.state[OBSERVED] = (kv.lengths.unsqueeze(-1) - slots).clamp(min=0).float()
        keep = per_sample_n_keep(n_keep, kv)  # (B, H)
        excess = kv.lengths - keep  # merges each row needs
        if int(excess.max()) <= 0:
            return kv
        average = kv.state[ACCUMULATED] / kv.state[OBSERVED].clamp(min=1)  # a_bar, (B, H, T)
        order = self._merge_order(kv, keep, average)
        values, alive = merge_into_right(kv.values, average, order, excess)
        index, lengths = keep_topk(alive.float(), keep, kv.lengths)  # survivors, in order
        return replace(kv, values=values).gather(index, lengths)

    def _merge_order(self, kv: LayerKV, keep: Tensor, average: Tensor) -> Tensor:
        """(B, H, T) slots sorted by merge order: region slots by ascending a_bar (never-observed ones last),
        then everything else; each row merges its first ``len - keep`` entries."""
        sinks = torch.minimum(keep.clamp(max=self.sinks), keep - 1)
        wanted = keep // 2 - sinks if self.recent is None else torch.full_like(keep, self.recent)
        recent = torch.minimum(wanted.clamp(min=1), (keep - sinks).clamp(min=1))
        slots = torch.arange(kv.capacity, device=kv.keys.device).view(1, 1, -1)
        region = (slots >= sinks.unsqueeze(-1)) & (slots < (kv.lengths - recent).unsqueeze(-1))
        observed = kv.state[OBSERVED] > 0
        key = torch.where(observed, average, torch.finfo(torch.float32).max)
        key = torch.where(region, key, float("inf"))
        return torch.sort(key, dim=-1, stable=True).indices


def merge_into_right(values: Tensor, average: Tensor, order: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
    """Merge slots ``order[..., i]`` for i < count into their nearest surviving right neighbour, in that order.

    values: (B, H, T, D); average: (B, H, T) merge weights a_bar; order: (B, H, T) long; count: (B, H) long.
    Returns (values with every merge applied (B, H, T, D) in values' dtype, alive (B, H, T) bool survivors).
    """
    B, H, T, D = values.shape
    slots = torch.arange(T, device=values.device).view(1, 1, -1).expand(B, H, T)
    right, left = (slots + 1).clone(), (slots - 1).clone()  # linked list of surviving slots
    merged = values.float().clone()
    alive = torch.ones(B, H, T, dtype=torch.bool, device=values.device)
    for i in range(int(count.max())):
        active = (i < count).unsqueeze(-1)  # (B, H, 1)
        j = order[..., i:i + 1]  # (B, H, 1) slot merged away
        r = right.gather(2, j).clamp(max=T - 1)
        p = left.gather(2, j)
        w_j, w_r = average.gather(2, j), average.gather(2, r)
        total = w_j + w_r
        f = torch.where(total > 0, w_j / total.clamp(min=torch.finfo(torch.float32).tiny), 0.5)
        v_j = merged.gather(2, j.unsqueeze(-1).expand(-1, -1, -1, D))
        v_r = merged.gather(2, r.unsqueeze(-1).expand(-1, -1, -1, D))
        new_r = torch.where(active.unsqueeze(-1), f.unsqueeze(-1) * v_j + (1 - f.unsqueeze(-1)) * v_r, v_r)
        merged.scatter_(2, r.unsqueeze(-1).expand(-1, -1, -1, D), new_r)
        p_safe = p.clamp(min=0)
        relink = active & (p >= 0)
        right.scatter_(2, p_safe, torch.where(relink, r, right.gather(2, p_safe)))
        left.scatter_(2, r, torch.where(active, p, left.gather(2, r)))
        alive.scatter_(2, j, alive.gather(2, j) & ~active)
    return merged.to(values.dtype), alive
