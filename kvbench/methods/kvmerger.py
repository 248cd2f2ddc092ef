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
- recent_ratio / heavy_ratio are fractions (the paper's "0.17%" etc.). Defaults are the paper's 50%-budget
  setting (0.17 / 0.12); its 35% setting is recent_ratio=0.08 heavy_ratio=0.02.

Budget rule: threshold-driven, as in the paper. The realized per-head size is whatever the protected set
plus the merging leaves; the engine's ``n_keep`` is informational and the realized size is reported
(``kept_per_layer_head``, ``kept_fraction``). With ``enforce_budget=true`` (a deviation) rows still above
``n_keep`` after merging drop their lowest-score slots: protected slots outrank merged/unprotected ones, and
within a tier the higher score wins; a merged slot's score is the summed attention of its set.

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
from kvbench.kernels.select import topk_mask
from kvbench.kernels.similarity import adjacent_cosine, anchor_runs, chain_runs
from kvbench.kv import LOGIT_BIAS, AttentionStats, LayerKV
from kvbench.methods.base import Method, check_unit_interval

GROUPINGS = ("chain", "anchor")
VALUE_SCALINGS = ("set_size", "none", "proportional")


@dataclass
class KVMerger(Method):
    """epsilon: key cosine threshold; recent_ratio, heavy_ratio: protected fractions of the prompt;
    sigma: "adaptive" or a fixed Gaussian width; grouping, value_scaling, enforce_budget: see module doc."""

    name: ClassVar[str] = "kvmerger"
    needs: ClassVar[frozenset[str]] = frozenset({"column_sums"})
    phases: ClassVar[frozenset[str]] = frozenset({"prefill"})

    epsilon: float = 0.75
    recent_ratio: float = 0.17
    heavy_ratio: float = 0.12
    sigma: float | str = "adaptive"
    grouping: str = "chain"
    value_scaling: str = "set_size"
    enforce_budget: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_unit_interval(self.name, recent_ratio=self.recent_ratio, heavy_ratio=self.heavy_ratio)
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

    def compress(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor, phase: str) -> LayerKV:
        valid = kv.valid()
        score = torch.zeros(kv.positions.shape, dtype=torch.float32, device=kv.keys.device)
        t = min(stats.column_sums.shape[-1], kv.capacity)  # statistics cover slots [0, t)
        score[..., :t] = stats.column_sums[..., :t].float()
        score = score.masked_fill(~valid, 0)
        protected = self.protected(score, kv.lengths, valid)
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

    def protected(self, score: Tensor, lengths: Tensor, valid: Tensor) -> Tensor:
        """(B, H, T) bool: recent window + heavy hitters (top column sums outside the window)."""
        # ceil(ratio * n); the small tolerance stops float error (0.17 * 100 = 17.000000000000004) adding one.
        n_recent = torch.ceil(self.recent_ratio * lengths.double() - 1e-9).long()
        n_heavy = torch.ceil(self.heavy_ratio * lengths.double() - 1e-9).long()
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
        order = (~keep).to(torch.int8).argsort(dim=-1, stable=True)[..., : int(lengths.max())]
        return merged.gather(order, lengths)
