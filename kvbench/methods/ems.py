"""EMS: Evict-then-Merge Strategy with a Global-Local score (Li et al.; spec: design/methods.md §2).

Per layer and KV head, with N_budget = ``n_keep`` stored entries:
  score   s_GloLoc = max(s_Glo * mean(s_Loc) / mean(s_Glo), s_Loc)       (Eq. 2; mean pooling, kernel 7, at prefill)
  Loc     the last ``window`` (L_win) slots: always kept, never merged
  Imp     the next N_budget - L_win by score: class centres
  TBM     the next (gamma - 1) * N_budget: merged into their most redundant centre if
          R = cos(raw k) * cos(v) >= tau, otherwise merged into the zero class (= evicted)
  Irr     the rest: evicted (first-level eviction)
A centre's merge is score-weighted (w_j = s_j / sum over its cluster); keys are merged as unit raw-key
directions with the members' norms kept apart, values as they are.
Decoding (every step): the token leaving the local window becomes a centre and the lowest-scoring centre
becomes the TBM token, merged into its most redundant other centre or evicted. Here that is the same
partition run on the row's N_budget + 1 slots, so prefill and decode share one code path.

Shared entry expansion, as this engine supports it [I]. The paper stores N_budget entries plus a position
look-up table (LUT) and, inside attention, expands each centre to one key per member: ||k_j|| * k_hat_c,
RoPE'd at pos_j ("w. pos") or at the centre's position ("w.o. pos"). This engine's attention reads only the
stored slots and calls no method hook, so the LUT expansion is NOT implemented. Each centre instead stores
the score-weighted MEAN of its members' expanded keys,
    key_c = sum_j w_j * ||k_j|| * RoPE_{p_j}(k_hat_c),   k_hat_c = normalise(sum_j w_j k_j_raw / ||k_j_raw||),
with p_j = pos_j (positions="with") or p_j = pos_c (positions="without": key_c = mean norm * RoPE_{p_c}(k_hat_c)),
so the entry's attention logit is exactly the weighted mean of the logits the expanded members would get.
RoPE at a member's position is read off that member's own raw/rotated key pair (``rotate_like``).
Multiplicity (``multiplicity_bias``, [I]): expanded, a cluster of m members takes m softmax shares, one per
member whatever its merge weight (the weights only shape the shared direction and the value). With
``multiplicity_bias=true`` (default) the entry keeps the per-slot ``state["logit_bias"] = log m``, m = the
plain count of original tokens it stands for (not a score-weighted effective count: every expanded member
is one share), carried through decode merges (counts add; zero-class members are gone and do not count), so
its softmax weight is m * exp(mean logit): exactly the expanded cluster's when its members' logits coincide
(e.g. "w.o. pos" with equal norms), where an unbiased entry gets 1/m of it. What is still lost: the spread
of the members' logits (m * exp(mean) is not the sum of their exps), and with ``multiplicity_bias=false``
the multiplicity itself (one share per cluster).
k_hat_c is renormalised to unit length (the paper does not say) so that members keep their norms exactly.

Per-slot state (LayerKV.state, moves with the slot):
  s_glo                 accumulated attention from every query (prompt, then each decode step)
  s_loc_past, s_loc_cur local accumulators: past = last full window of L_win decode queries, cur = the
                        ones since; s_Loc = past + cur (prefill: past = the prompt's last L_win queries)
  s_loc_cur_queries     queries summed into s_loc_cur (the same on every slot of a row)
  merged_mass           merge weight of the members absorbed into this entry; an entry's merge weight is
                        its current score + merged_mass, so clusters merged again at decode keep their mass
  merged_tokens         original tokens merged into this entry besides its own (m - 1; new tokens start at 0)
  logit_bias            log m, only with multiplicity_bias (see above); read by the engine's attention
Key norms need no state: a stored key's norm is its members' weighted mean norm, and RoPE keeps norms.

Readings [I], see §2.g: merge weights are the pooled Global-Local score at prefill and score + merged_mass
at decode; a merged entry keeps its centre's own s_Glo/s_Loc (it is ranked as the centre); pooling is applied
at prefill only (at decode stored slots are no longer neighbours in the text); GQA: budgets and merges are per
KV head with attention averaged over the group (the engine's statistics); cosines in R are clamped at 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import Tensor

from kvbench.errors import ConfigError
from kvbench.kernels.merge import group_sum, scatter_merge
from kvbench.kernels.redundancy import SIMILARITIES, redundancy, rotate_like
from kvbench.kernels.select import pool1d
from kvbench.kernels.similarity import unit_keys
from kvbench.kv import LOGIT_BIAS, AttentionStats, LayerKV
from kvbench.methods.base import Method, check_unit_interval, per_sample_n_keep

POSITIONS = ("with", "without")
EXPANSIONS = ("bias",)
STATE = ("s_glo", "s_loc_past", "s_loc_cur", "s_loc_cur_queries", "merged_mass", "merged_tokens")


def global_local_score(s_glo: Tensor, s_loc: Tensor, valid: Tensor) -> Tensor:
    """EMS Eq. 2 on (B, H, T) tensors: max(s_Glo * mean(s_Loc) / mean(s_Glo), s_Loc); 0 on padding.

    Means are over each row's real slots (the N cancels). A row without global mass scores by s_Loc alone.
    """
    s_glo, s_loc = s_glo.float() * valid, s_loc.float() * valid
    total_glo = s_glo.sum(-1, keepdim=True)
    ratio = torch.where(total_glo > 0, s_loc.sum(-1, keepdim=True) / total_glo.clamp(min=1e-30), 0.0)
    return torch.maximum(s_glo * ratio, s_loc)



@dataclass
class EMS(Method):
    """window: L_win; kernel_size: mean pooling of the score; tau: merge threshold on R; gamma: merge
    magnification (N_budget + N_tbm) / N_budget (1 = eviction only, inf = no first-level eviction);
    similarity: key_value | key | value; positions: with | without (EMS w. pos / w.o. pos);
    multiplicity_bias: add log(member count) to a merged entry's attention logit [I]."""

    name: ClassVar[str] = "ems"
    needs: ClassVar[frozenset[str]] = frozenset({"column_sums", "window_column_sums", "raw_keys"})
    decode_needs: ClassVar[frozenset[str]] = frozenset({"step_attention", "raw_keys"})
    phases: ClassVar[frozenset[str]] = frozenset({"prefill", "decode"})

    window: int = 32
    kernel_size: int = 7
    tau: float = 0.6
    gamma: float = 4
    similarity: str = "key_value"
    positions: str = "without"
    multiplicity_bias: bool = True
    expansion: str = "bias"
    compress_during_decode: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1 or int(self.window) != self.window:
            raise ConfigError(f"ems: window={self.window} must be an integer >= 1")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ConfigError(f"ems: kernel_size={self.kernel_size} must be an odd integer >= 1")
        check_unit_interval(self.name, tau=self.tau)
        if not self.gamma >= 1:
            raise ConfigError(f"ems: gamma={self.gamma} must be >= 1 (1 = eviction only, inf = no first-level eviction)")
        if self.similarity not in SIMILARITIES:
            raise ConfigError(f"ems: similarity '{self.similarity}'; accepted: {', '.join(SIMILARITIES)}")
        if self.positions not in POSITIONS:
            raise ConfigError(f"ems: positions '{self.positions}'; accepted: {', '.join(POSITIONS)}")
        if self.expansion not in EXPANSIONS:
            raise ConfigError(f"ems: expansion '{self.expansion}'; accepted: {', '.join(EXPANSIONS)}")

    # -- engine hooks ---------------------------------------------------------------------------------

    def compress(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor, phase: str) -> LayerKV:
        valid = kv.valid()
        if phase == "prefill":
            kv = replace(kv, state=self._prefill_state(kv, stats))
            score = self._pooled(global_local_score(kv.state["s_glo"], kv.state["s_loc_past"], valid), valid)
        else:
            s_loc = kv.state["s_loc_past"] + kv.state["s_loc_cur"]
            score = global_local_score(kv.state["s_glo"], s_loc, valid)
        raw_keys = stats.raw_keys
        return self._evict_then_merge(kv, raw_keys, score, per_sample_n_keep(n_keep, kv))

    def observe(self, layer: int, kv: LayerKV, stats: AttentionStats) -> None:
        """Accumulate the newest query's attention into s_Glo and s_Loc^cur; roll the local window every
        L_win queries (s_Loc^past <- s_Loc^cur, s_Loc^cur <- 0)."""
        state, valid = kv.state, kv.valid()
        step = stats.step_attention.float() * valid
        state["s_glo"] = state["s_glo"] + step
        cur = state["s_loc_cur"] + step
        queries = state["s_loc_cur_queries"].amax(-1, keepdim=True) + 1  # (B, H, 1)
        rolled = queries >= self.window
        state["s_loc_past"] = torch.where(rolled, cur, state["s_loc_past"])
        state["s_loc_cur"] = torch.where(rolled, torch.zeros_like(cur), cur)
        state["s_loc_cur_queries"] = torch.where(rolled, 0, queries).float() * valid

    # -- the algorithm --------------------------------------------------------------------------------

    def _prefill_state(self, kv: LayerKV, stats: AttentionStats) -> dict[str, Tensor]:
        """Fresh per-slot state from the prompt pass: s_Glo = column sums, s_Loc^past = window column sums."""
        T = kv.capacity
        s_glo = stats.column_sums.float()
        state = {name: torch.zeros_like(s_glo) for name in STATE}
        state["s_glo"] = s_glo
        state["s_loc_past"] = stats.window_column_sums.float()
        return state

    def _pooled(self, score: Tensor, valid: Tensor) -> Tensor:
        """(B, H, T) mean pooling over each slot's real neighbours (ragged rows end in padding, not zeros)."""
        neighbours = pool1d(valid.float(), self.kernel_size, "mean").clamp(min=1e-30)
        return pool1d(score, self.kernel_size, "mean") / neighbours * valid

    def _partition(self, score: Tensor, valid: Tensor, lengths: Tensor, n_keep: Tensor) -> tuple[Tensor, ...]:
        """(B, H, T) score -> masks local, imp (B, H, T); tbm_slots (B, H, M) and its validity (B, H, M).

        Slots outside the local window are ranked by score: Imp = the top N_budget - L_win, TBM = the next
        (gamma - 1) * N_budget, Irr = the rest. TBM slots come out in rank order.
        """
        T = score.shape[-1]
        slots = torch.arange(T, device=score.device).view(1, 1, -1)
        n_loc = n_keep.clamp(max=self.window)
        local = valid & (slots >= (lengths - n_loc).unsqueeze(-1))
        candidate = valid & ~local
        n_imp = n_keep - n_loc
        if math.isinf(self.gamma):
            n_tbm = torch.full_like(n_keep, T)
        else:
            n_tbm = torch.floor((self.gamma - 1) * n_keep.double() + 0.5).long()
        n_tbm = torch.minimum(n_tbm, (candidate.sum(-1) - n_imp).clamp(min=0))
        order = torch.where(candidate, score, -torch.inf).argsort(dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(-1, order, slots.expand_as(order).contiguous())
        imp = candidate & (rank < n_imp.unsqueeze(-1))
        M = int(n_tbm.max()) if n_tbm.numel() else 0
        offset = torch.arange(M, device=score.device).view(1, 1, -1)
        tbm_valid = offset < n_tbm.unsqueeze(-1)
        tbm_slots = order.gather(-1, (n_imp.unsqueeze(-1) + offset).clamp(max=T - 1))
        return local, imp, tbm_slots, tbm_valid

    def _destinations(self, kv: LayerKV, raw_keys: Tensor, imp: Tensor, tbm_slots: Tensor) -> Tensor:
        """Most redundant centre of each TBM slot (Eq. 5): (B, H, M) slot index, or -1 (zero class: R < tau)."""
        n_imp = imp.sum(-1)
        C = int(n_imp.max()) if n_imp.numel() else 0
        if C == 0 or tbm_slots.shape[-1] == 0:
            return torch.full_like(tbm_slots, -1)
        centres = (~imp).to(torch.int8).argsort(dim=-1, stable=True)[..., :C]  # (B, H, C) Imp slots first
        centre_ok = torch.arange(C, device=imp.device).view(1, 1, -1) < n_imp.unsqueeze(-1)

        def rows(x: Tensor, slots: Tensor) -> Tensor:
            return x.gather(2, slots.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))

        R = redundancy(rows(raw_keys, tbm_slots), rows(kv.values, tbm_slots),
                       rows(raw_keys, centres), rows(kv.values, centres), self.similarity)  # (B, H, M, C)
        R = R.masked_fill(~centre_ok.unsqueeze(2), -1.0)
        best, arg = R.max(-1)
        return torch.where(best >= self.tau, centres.gather(-1, arg), -1)

    def _evict_then_merge(self, kv: LayerKV, raw_keys: Tensor, score: Tensor, n_keep: Tensor) -> LayerKV:
        """Keep Loc + Imp (original order), merge redundant TBM slots into their centres, evict the rest."""
        valid = kv.valid()
        local, imp, tbm_slots, tbm_valid = self._partition(score, valid, kv.lengths, n_keep)
        kept = local | imp
        lengths = kept.sum(-1)
        G = max(int(lengths.max()) if lengths.numel() else 0, 1)
        index = (~kept).to(torch.int8).argsort(dim=-1, stable=True)[..., :G]  # kept slots in original order
        group = kept.long().cumsum(-1) - 1  # entry of each kept slot
        dest = self._destinations(kv, raw_keys, imp, tbm_slots)
        dest_group = torch.where(tbm_valid & (dest >= 0), group.gather(-1, dest.clamp(min=0)), -1)
        # invalid TBM entries write to a spare slot T that is dropped
        T = score.shape[-1]
        target = torch.cat([torch.where(kept, group, -1), group.new_full((*group.shape[:2], 1), -1)], -1)
        target.scatter_(-1, torch.where(tbm_valid, tbm_slots, T), dest_group)
        target = target[..., :T]

        weight = score + kv.state["merged_mass"]
        mass = group_sum(weight, target, G)  # (B, H, G)
        members = group_sum(torch.ones_like(weight), target, G)
        cluster = target.clamp(min=0)
        cluster_mass = mass.gather(-1, cluster)
        # convex weights inside each cluster; a cluster without any score mass merges uniformly
        w = torch.where(cluster_mass > 0, weight / cluster_mass.clamp(min=1e-30),
                        1.0 / members.gather(-1, cluster).clamp(min=1))
        out = kv.gather(index, lengths)
        own_score = score.gather(-1, index)
        out.state["merged_mass"] = torch.where(out.valid(), mass - own_score, 0.0)
        tokens = group_sum(kv.state["merged_tokens"] + 1, target, G)  # (B, H, G) original tokens per entry
        out.state["merged_tokens"] = torch.where(out.valid(), tokens - 1, 0.0)
        if self.multiplicity_bias:
            out.state[LOGIT_BIAS] = torch.where(out.valid(), tokens.clamp(min=1).log(), 0.0)
        merged = (members > 1).unsqueeze(-1)
        if not bool(merged.any()):  # every TBM slot went to the zero class: a plain gather
            return out
        out.keys = torch.where(merged, self._merged_keys(kv, raw_keys, target, w, index), out.keys)
        out.values = torch.where(merged, scatter_merge(kv.values, target, w, G), out.values)
        return out

    def _merged_keys(self, kv: LayerKV, raw_keys: Tensor, target: Tensor, w: Tensor, index: Tensor) -> Tensor:
        """(B, H, G, D): per entry, the w-weighted mean of its members' expanded keys (see module doc)."""
        G = index.shape[-1]
        norms = kv.keys.float().norm(dim=-1, keepdim=True)  # (B, H, T, 1): RoPE keeps norms
        shared = unit_keys(scatter_merge(unit_keys(raw_keys), target, w, G))  # k_hat_c, renormalised
        if self.positions == "without":
            d_index = index.unsqueeze(-1).expand(-1, -1, -1, kv.keys.shape[-1])
            at_centre = rotate_like(shared, raw_keys.gather(2, d_index), kv.keys.gather(2, d_index))
            return (at_centre * scatter_merge(norms, target, w, G)).to(kv.keys.dtype)
        d_target = target.clamp(min=0).unsqueeze(-1).expand(-1, -1, -1, kv.keys.shape[-1])
        expanded = rotate_like(shared.gather(2, d_target), raw_keys, kv.keys) * norms  # (B, H, T, D)
        return scatter_merge(expanded, target, w, G).to(kv.keys.dtype)
