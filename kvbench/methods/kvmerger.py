"""KVMerger (Wang, Jin, Yu, Zhang, "Model Tells You Where to Merge: Adaptive KV Cache Merging for LLMs on
Long-Context Tasks"), methods.md §1.

After the prompt, per layer and per KV head:
1. Protected ("conserved") set: the last ceil(recent_ratio * n) slots, plus the top ceil(heavy_ratio * n)
   slots by accumulated prompt attention a_j (column sums) among the others (sinks and heavy hitters).
2. Merging sets: runs of consecutive unprotected slots whose keys are similar (cosine > epsilon), found
   from the last slot to the first (Algorithm 1). A protected slot breaks a run [I, §1.g.6].
3. Each set S with |S| >= 2 becomes one slot (Algorithm 2, Eqs. 5-8): pivot p = argmax_{j in S} a_j,
   g_j = exp(-||k_p - k_j||^2 / (2 sigma^2)), w_j = g_j / sum_S g, k = sum w_j k_j, v = |S| sum w_j v_j;
   the merged slot keeps the pivot's position (order and RoPE position id) [I].
Decode: new tokens are appended, never merged (the paper describes no decode-time merging) [I].

Readings where the paper is ambiguous (methods.md §1.g), each a config switch:
- grouping="chain" (recommended, Algorithm 1 literally: compare adjacent keys k_{j+1}, k_j);
  "anchor": compare each candidate with the run's right-most key (§3.2's prose).
- sigma="adaptive" (recommended non-circular reading of Eq. 6): sigma = mean_{j in S} ||k_p - k_j|| / sqrt 2,
  i.e. 2 sigma^2 = (mean key distance to the pivot)^2; a set whose keys all coincide gets equal weights.
  A number (e.g. 5, the Table 3 optimum) fixes sigma.
- value_scaling="set_size" (as stated: "w_i and w_p should also multiply |S_v|"); "none" keeps the convex
  value average (a deviation from the paper); "proportional" (a deviation, the spec's documented alternative,
  methods.md §1.g.5) keeps the convex value average and adds log|S| to the merged slot's attention logit
  (ToMe-style proportional attention, per-slot ``state["logit_bias"]``), so the set takes |S| softmax shares
  instead of one share with an |S|-times value.
- a_j is read as the column sum of the prompt attention (Algorithm 2 writes a row sum, identically 1).
- recent_ratio / heavy_ratio are fractions (the paper's "0.17%" etc.) and, as in the paper, they follow the
  budget: 50% -> 0.17 / 0.12, 35% -> 0.08 / 0.02 (§5.1). ``null`` (default) derives them from the run's
  budget b = n_keep / prompt length of each row (``budget_ratios``); numbers fix them for every budget.
- [I] Budgets other than the paper's two: linear between 35% and 50%, the same line continued above 50%
  (1.0 -> 0.47 / 0.45, protecting 92% of the prompt), and below 35% the 35% setting scaled with the budget
  (0.2 -> 0.046 / 0.011: a small recent window and the top heavy hitters, attention sinks among them, stay
  protected). The paper gives no third point. Since b comes from the integer n_keep, a protected count can
  differ by one slot from ceil(ratio * n) at the exact label.

Budget rule: threshold-driven, as in the paper: the budget sets the protected share, the cosine threshold
sets how much of the rest merges, and the realized per-head size is whatever both leave. It is reported
beside the budget label everywhere (``kept_per_layer_head``, ``kept_fraction`` in the rows; the report's
"Kept" column and plot labels): at epsilon 0.75 merging keeps roughly 0.3 of the unprotected slots
(methods.md §1.e), so a budget under about 0.3 is not reached. With ``enforce_budget=true`` (a deviation)
rows still above ``n_keep`` after merging drop their lowest-score slots: protected slots outrank
merged/unprotected ones, and within a tier the higher score wins; a merged slot's score is the summed
attention of its set.

Cost: needs the prompt's column sums (the engine's O(n^2) attention pass, chunked). The compression itself is
O(n d) for the n-1 adjacent cosines and the merge, O(n log n) for the heavy-hitter ranking; one shot per
layer after the prompt; zero per decode step (with value_scaling="proportional" decoding attends through the
engine's ragged path, which adds the bias, instead of the wrapped FlashAttention/SDPA kernel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvbench.errors import ConfigError
from kvbench.kernels.merge import group_sum, scatter_merge
from kvbench.kernels.select import topk_mask, true_first
from kvbench.kernels.similarity import adjacent_cosine, anchor_runs, chain_runs
from kvbench.kv import LOGIT_BIAS, AttentionStats, HostSizes, LayerKV
from kvbench.methods.base import Method, check_unit_interval

GROUPINGS = ("chain", "anchor")
# budget -> (recent_ratio, heavy_ratio): the paper's two settings (§5.1) and the readings around them [I]
# (module docstring): 0 at budget 0, the 35% setting scaled below it, linear through 35% and 50% and beyond.
PAPER_RATIOS = ((0.0, 0.0, 0.0), (0.35, 0.08, 0.02), (0.5, 0.17, 0.12), (1.0, 0.47, 0.12 + 0.5 * 0.10 / 0.15))
VALUE_SCALINGS = ("set_size", "none", "proportional")


@dataclass
class KVMerger(Method):
    """epsilon: key cosine threshold; recent_ratio, heavy_ratio: protected fractions of the prompt (null: from
    the budget, as the paper ties them); sigma: "adaptive" or a fixed Gaussian width; grouping, value_scaling, enforce_budget: see module doc."""

    name: ClassVar[str] = "kvmerger"
    needs: ClassVar[frozenset[str]] = frozenset({"column_sums"})
    phases: ClassVar[frozenset[str]] = frozenset({"prefill"})

    epsilon: float = 0.75
    recent_ratio: float | None = None
    heavy_ratio: float | None = None
    sigma: float | str = "adaptive"
    grouping: str = "chain"
    value_scaling: str = "set_size"
    enforce_budget: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        fixed = {"recent_ratio": self.recent_ratio, "heavy_ratio": self.heavy_ratio}
        check_unit_interval(self.name, **{key: value for key, value in fixed.items() if value is not None})
        if not -1 <= self.epsilon <= 1:
            raise ConfigError(f"{self.name}: epsilon={self.epsilon} must be a cosine in [-1, 1]")
        if self.sigma != "adaptive" and (isinstance(self.sigma, (str, bool)) or not self.sigma > 0):
            raise ConfigError(f"{self.name}: sigma={self.sigma!r}; accepted: 'adaptive' or a number > 0")
        if self.grouping not in GROUPINGS:
            raise ConfigError(f"{self.name}: grouping '{self.grouping}'; accepted: {', '.join(GROUPINGS)}")
        if self.value_scaling not in VALUE_SCALINGS:
            raise ConfigError(
                f"{self.name}: value_scaling '{self.value_scaling}'; accepted: {', '.join(VALUE_SCALINGS)}"
            )

    @property
    def keeps_within_budget(self) -> bool:
        """Threshold-driven: without ``enforce_budget`` a row may keep its whole prompt."""
        return self.enforce_budget

    def compress(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor, phase: str,
                 host: HostSizes | None = None) -> LayerKV:
        valid = kv.valid()
        score = torch.zeros(kv.positions.shape, dtype=torch.float32, device=kv.keys.device)
        t = min(stats.column_sums.shape[-1], kv.capacity)  # statistics cover slots [0, t)
        score[..., :t] = stats.column_sums[..., :t].float()
        score = score.masked_fill(~valid, 0)
        protected = self.protected(score, kv.lengths, valid, self.ratios(n_keep, kv.lengths))
        groups = self.merging_sets(kv, valid & ~protected)  # (B, H, T) set id, -1 on padding
        num_sets = groups.amax(-1) + 1  # (B, H)
        G = int(num_sets.max())
        pivot = self.pivots(score, groups, G)  # (B, H, G) slot index of each set's pivot
        weight, size = self.gaussian_weights(kv.keys, groups, pivot, G)
        merged = kv.gather(pivot, num_sets)  # positions and state follow the pivot
        merged.keys = scatter_merge(kv.keys, groups, weight, G)
        value_weight = weight * size if self.value_scaling == "set_size" else weight
        merged.values = scatter_merge(kv.values, groups, value_weight, G)
        if self.value_scaling == "proportional":
            merged.state[LOGIT_BIAS] = group_sum((groups >= 0).float(), groups, G).clamp(min=1).log()  # log|S|
        merged.zero_padding()
        if self.enforce_budget:
            merged = self.evict_to_budget(merged, score, protected, groups, pivot, n_keep)
        return merged

    def ratios(self, n_keep: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """(recent_ratio, heavy_ratio), each (B, H) float64: the configured numbers, or where null the paper's
        setting for each row's budget b = n_keep / prompt length (``budget_ratios``)."""
        budget = n_keep.to(lengths).view(-1, 1).double() / lengths.double().clamp(min=1)
        recent, heavy = budget_ratios(budget)
        if self.recent_ratio is not None:
            recent = torch.full_like(budget, self.recent_ratio)
        if self.heavy_ratio is not None:
            heavy = torch.full_like(budget, self.heavy_ratio)
        return recent, heavy

    def protected(self, score: Tensor, lengths: Tensor, valid: Tensor,
                  ratios: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """(B, H, T) bool: recent window + heavy hitters (top column sums outside the window). ``ratios``:
        per-row (recent, heavy) fractions (``ratios``); default the configured numbers."""
        recent_ratio, heavy_ratio = ratios if ratios is not None else (self.recent_ratio, self.heavy_ratio)
        # ceil(ratio * n); the small tolerance stops float error (0.17 * 100 = 17.000000000000004) adding one.
        n_recent = torch.ceil(recent_ratio * lengths.double() - 1e-9).long()
        n_heavy = torch.ceil(heavy_ratio * lengths.double() - 1e-9).long()
        slots = torch.arange(score.shape[-1], device=score.device).view(1, 1, -1)
        recent = valid & (slots >= (lengths - n_recent).unsqueeze(-1))
        candidates = score.masked_fill(~valid | recent, -float("inf"))
        return recent | topk_mask(candidates, n_heavy)

    def merging_sets(self, kv: LayerKV, mergeable: Tensor) -> Tensor:
        """(B, H, T) long: id of the merging set of every real slot, in positional order; -1 on padding."""
        if self.grouping == "chain":
            return chain_runs(adjacent_cosine(kv.keys), mergeable, kv.lengths, self.epsilon)
        return anchor_runs(kv.keys, mergeable, kv.lengths, self.epsilon)

    @staticmethod
    def pivots(score: Tensor, groups: Tensor, G: int) -> Tensor:
        """(B, H, G) slot of the highest score in each set (ties -> the earliest slot); padding sets -> 0."""
        T = score.shape[-1]
        target = groups.clamp(min=0)
        best = torch.full((*score.shape[:2], G), -float("inf"), device=score.device)
        best = best.scatter_reduce(2, target, score.masked_fill(groups < 0, -float("inf")), "amax")
        is_best = (score == best.gather(2, target)) & (groups >= 0)
        slots = torch.arange(T, device=score.device).expand_as(groups)
        first = torch.full_like(best, T, dtype=torch.long)
        first = first.scatter_reduce(2, target, torch.where(is_best, slots, T), "amin")
        return torch.where(first < T, first, 0)

    def gaussian_weights(self, keys: Tensor, groups: Tensor, pivot: Tensor, G: int) -> tuple[Tensor, Tensor]:
        """Normalised Gaussian-kernel weights w_j (B, H, T) and the size |S| of each slot's set (B, H, T)."""
        target = groups.clamp(min=0)
        real = (groups >= 0).float()
        pivot_of_slot = pivot.gather(2, target)  # (B, H, T)
        pivot_key = keys.float().gather(2, pivot_of_slot.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
        sq_dist = ((keys.float() - pivot_key) ** 2).sum(-1) * real  # ||k_p - k_j||^2, 0 at the pivot
        size = group_sum(real, groups, G).gather(2, target)
        if self.sigma == "adaptive":
            mean_dist = group_sum(sq_dist.sqrt(), groups, G).gather(2, target) / size.clamp(min=1)
            two_sigma_sq = mean_dist**2  # 2 sigma^2 with sigma = mean distance / sqrt 2
        else:
            two_sigma_sq = torch.full_like(sq_dist, 2 * float(self.sigma) ** 2)
        # A set of identical keys has sigma = 0 and all distances 0: every member weighs g = 1.
        g = torch.where(sq_dist > 0, torch.exp(-sq_dist / two_sigma_sq.clamp(min=1e-30)), 1.0) * real
        weight = g / group_sum(g, groups, G).gather(2, target).clamp(min=1e-30)
        return weight, size

    @staticmethod
    def evict_to_budget(
        merged: LayerKV, score: Tensor, protected: Tensor, groups: Tensor, pivot: Tensor, n_keep: Tensor
    ) -> LayerKV:
        """Optional deviation: drop the lowest-score slots of rows still above ``n_keep`` (B,)."""
        G = pivot.shape[-1]
        set_score = group_sum(score, groups, G)  # (B, H, G) summed attention of each set
        set_protected = protected.gather(2, pivot)  # protected slots are sets of one
        # Protected slots outrank the others whatever their scores (scores are attention sums in [0, n]).
        priority = set_score + set_protected.float() * (1.0 + score.sum(-1, keepdim=True))
        priority = priority.masked_fill(~merged.valid()[..., :G], -float("inf"))
        keep = topk_mask(priority, torch.minimum(merged.lengths, n_keep.to(merged.lengths).view(-1, 1)))
        lengths = keep.sum(-1)
        order = true_first(keep)[..., : int(lengths.max())]
        return merged.gather(order, lengths)


def budget_ratios(budget: Tensor) -> tuple[Tensor, Tensor]:
    """Budget fractions (any shape) -> (recent_ratio, heavy_ratio), piecewise linear through ``PAPER_RATIOS``
    (budgets above 1 read as 1)."""
    b = budget.double().clamp(0, 1)
    recent, heavy = torch.zeros_like(b), torch.zeros_like(b)
    for (b0, r0, h0), (b1, r1, h1) in zip(PAPER_RATIOS, PAPER_RATIOS[1:]):
        inside = (b >= b0) & (b <= b1)
        t = (b - b0) / (b1 - b0)
        recent = torch.where(inside, r0 + t * (r1 - r0), recent)
        heavy = torch.where(inside, h0 + t * (h1 - h0), heavy)
    return recent, heavy
