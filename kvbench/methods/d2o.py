"""D2O, Dynamic Discriminative Operations (Wan et al., ICLR 2025). methods.md §3; the paper text lost its
equations, so formulas are reconstructed from its prose and, where marked [C], the authors' code.

Layer level (once, from the prompt attention), ``layer_budgets``, as the authors' code computes it [C]
(``modeling_llama3_7b_13b_d2o.py`` + ``modeling_llama3_new.py``):
- per *query* head h (the code repeats the KV heads to the query heads before attention, so a GQA group's
  heads are not averaged): c_h = the prompt column sums of h (statistic ``query_column_sums``), var_h = their
  variance over the prompt's slots (unbiased, ``torch.var``);
- min-max normalised across the query heads of the layer, (var_h - min) / (max - min + 1e-6), and averaged
  over heads: D_l in [0, 1]; lambda = softmax_l(-D_l) ("inverse variance softmax"; alternatives
  ``allocation``: reciprocal_variance lambda ~ 1 / mean_h var_h, uniform) [P names, Table 4].
- S_l = lambda_l * L * n_keep (alpha, the compression ratio, is the run's budget: n_keep = alpha * prompt),
  each clamped to [0.01, 1] * prompt [C] and rounded so that sum_l S_l = L * n_keep exactly (the code only
  clamps, so its total drifts).
- ``protect_layers``: layers kept at the full prompt length (the code keeps 0, 1 and L-1 uncompressed); they
  count inside the total, so the other layers share L * n_keep - |protected| * prompt.
What the code does differently from the prose (the prose: denser layers, i.e. smaller attention variance,
get more cache): the per-layer min-max normalisation makes D_l scale-free. It measures where a layer's heads
sit between its own least and most varied head, not how large the layer's variance is, so higher variance
means a smaller budget only when it is spread over more of the layer's heads (a layer with one sink head
among uniform ones gets more than a layer where most heads are sinks; but a layer whose heads all have equal
high variance gets D_l = 0, the largest budget). Also the code averages the variance over the batch
(kvbench: per sample [I]) and computes it over padded rows (kvbench: the real slots).
Peak memory: the layer budgets need every layer's prompt statistics before any layer is compressed, so the
engine holds the whole uncompressed prompt cache until the prompt pass ends, plus per layer the column sums
(B, H_kv, T) in float32 (no second copy of the cache). The per-query-head column sums (B, H_q, T) are read
once, right after the layer's attention, into the layer's variances (``budget_statistic``), and dropped. For
the same reason D2O refuses chunked prefill (``engine.prefill_chunk_size``) [I].
Token level (prefill and every decode step), ``compress``:
- keep n_sinks sinks + M recent + top-N accumulated attention (sinks inside N, [C]), N:M = n_heavy:n_recent;
  the recent share of a layer budget S_l is floor(S_l * M / (N + M)), as the code floors it
  (``int(S * layer_recent_ratio)``), and the heavy share takes the rest [I] (the code floors it too and can
  keep one slot less than S_l);
- every evicted e finds its most similar kept c by key cosine (post-RoPE keys, [C]): u_e = max_c cos(k_e, k_c);
- EMA threshold: tau = mean_e u_e at the first compression, then tau = beta * mean_e u_e + (1 - beta) * tau_prev;
  e merges iff u_e >= tau (this step's tau), else it is discarded [P Eq. 10];
- ``merge_rule="weighted"`` [P Eqs. 11-12, GAT-style]: for kept c with merge set E_c,
  Z = e^1 + sum_e exp(u_e), k_c <- (e^1 k_c + sum_e exp(u_e) k_e) / Z, same weights for v_c (convex);
  ``merge_rule="code_mean"`` [C]: k_c <- (k_c + sum_e u_e k_e) / (1 + |E_c|) (weights do not sum to 1).

Interpretations:
- [I] ``threshold_scope="head"`` (recommended): one tau per (sample, layer, KV head), per-head decisions.
  ``"layer"`` [C]: one tau per (sample, layer) = mean of u over every evicted (head, token) pair; each head
  still decides with its own u_e. The threshold lives in the cache (state "ema_threshold", the row's tau
  repeated on every slot; NaN until the row's first eviction), so it follows its sequence and layer.
- [I] Budgets are computed per sample (the code averages the variance over the batch).
- [I] A merged kept slot keeps its own position and accumulated attention.
- [I] Prompt compression happens right after the prompt pass (the code defers it to the first decode step).
- [I] A budget at or above the prompt length gives every layer n_keep (nothing to allocate at prefill).
- [I] GQA: the engine averages the attention of the query heads of each KV group; merges are per KV head.

Cost per compression of a row (T slots, S_l kept, E = T - S_l evicted, head dim d): selection O(T log T),
matching O(E * S_l * d) (prefill: the |E| x |C| block in chunks; decode: E = 1, so O(S_l * d)), merge O(T d);
a decode step in place (``evict_one``): O(T) selection, O(S_l * d) matching, O(d) merge, O(T) threshold state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from kvbench.errors import ConfigError
from kvbench.kernels.d2o_step import d2o_step, ema_threshold, merge_terms, protection
from kvbench.kernels.merge import group_sum, scatter_merge
from kvbench.kernels.select import keep_topk
from kvbench.kernels.similarity import best_match_cosine
from kvbench.kv import AttentionStats, HostSizes, LayerKV
from kvbench.methods.base import Method, check_unit_interval, per_sample_n_keep
from kvbench.methods.base import check_count

ATTENTION = "attention"
THRESHOLD = "ema_threshold"
ALLOCATIONS = ("inverse_variance_softmax", "reciprocal_variance", "uniform")
SCOPES = ("head", "layer")
MERGE_RULES = ("weighted", "code_mean")
MIN_LAYER_RATIO = 0.01  # [C] a layer keeps at least 1% of the prompt


@dataclass
class D2O(Method):
    """beta: EMA weight of the current similarity. n_heavy:n_recent: heavy-hitter : recent split of a layer's
    budget. n_sinks: first tokens always kept (inside the heavy share). allocation, protect_layers,
    threshold_scope, merge_rule: see the module docstring."""

    name: ClassVar[str] = "d2o"
    keeps_exact_budget: ClassVar[bool] = True
    needs: ClassVar[frozenset[str]] = frozenset({"column_sums", "query_column_sums"})
    decode_needs: ClassVar[frozenset[str]] = frozenset({"step_attention"})
    phases: ClassVar[frozenset[str]] = frozenset({"prefill", "decode"})
    budget_needs: ClassVar[frozenset[str]] = frozenset({"query_column_sums"})  # every layer's, before any compression
    evicts_in_place: ClassVar[bool] = True

    beta: float = 0.7
    n_heavy: int = 3
    n_recent: int = 1
    n_sinks: int = 4
    allocation: str = "inverse_variance_softmax"
    protect_layers: list[int] = field(default_factory=list)
    threshold_scope: str = "head"
    merge_rule: str = "weighted"
    compress_during_decode: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_unit_interval(self.name, beta=self.beta)
        check_count(self.name, 0, n_heavy=self.n_heavy, n_recent=self.n_recent, n_sinks=self.n_sinks)
        if self.n_heavy + self.n_recent == 0:
            raise ConfigError("d2o: n_heavy + n_recent must be > 0")
        self.protect_layers = [int(layer) for layer in self.protect_layers]
        for key, value, accepted in (("allocation", self.allocation, ALLOCATIONS),
                                     ("threshold_scope", self.threshold_scope, SCOPES),
                                     ("merge_rule", self.merge_rule, MERGE_RULES)):
            if value not in accepted:
                raise ConfigError(f"d2o: unknown {key} '{value}'; accepted: {', '.join(accepted)}")

    # -- layer level ---------------------------------------------------------------------------------

    def layer_weights(self, prefill_stats: list[AttentionStats]) -> Tensor:
        """(L, B) unnormalised allocation weights lambda from each layer's per-query-head prompt column sums
        (B, H_q, T), as the authors' code computes them (module docstring)."""
        if self.allocation == "uniform":
            return torch.ones(len(prefill_stats), prefill_stats[0].num_queries.shape[0], dtype=torch.float64)
        var = torch.stack([stats.budget_statistic if stats.budget_statistic is not None
                           else prompt_variances(stats) for stats in prefill_stats]).cpu()  # (L, B, H_q)
        if self.allocation == "reciprocal_variance":
            return 1.0 / var.mean(-1).clamp(min=1e-12)
        low, high = var.amin(-1, keepdim=True), var.amax(-1, keepdim=True)
        density = ((var - low) / (high - low + 1e-6)).mean(-1)  # D_l in [0, 1], (L, B); 1e-6 as the code
        return torch.softmax(-density, dim=0)

    def budget_statistic(self, stats: AttentionStats) -> Tensor | None:
        """``prompt_variances`` of a layer; None for ``allocation="uniform"``, which reads nothing."""
        return None if self.allocation == "uniform" else prompt_variances(stats)

    def layer_budgets(
        self, n_keep: Tensor, num_layers: int, prefill_stats: list[AttentionStats], max_new_tokens: int
    ) -> Tensor:
        """(B,) -> (L, B) per-layer budgets summing to L * n_keep per sample (module docstring)."""
        bad = [layer for layer in self.protect_layers if not 0 <= layer < num_layers]
        if bad:
            raise ConfigError(f"d2o: protect_layers {bad} outside the model's layers 0..{num_layers - 1}")
        weights = self.layer_weights(prefill_stats)
        prompt = prefill_stats[0].num_queries.cpu()
        budgets = torch.empty(num_layers, len(n_keep), dtype=torch.long)
        free = torch.tensor([layer not in self.protect_layers for layer in range(num_layers)])
        for b, (keep, length) in enumerate(zip(n_keep.tolist(), prompt.tolist())):
            if keep >= length:
                budgets[:, b] = keep
                continue
            rest = num_layers * keep - (num_layers - int(free.sum())) * length
            if rest < int(free.sum()):
                raise ConfigError(
                    f"d2o: protect_layers={self.protect_layers} keep {length} tokens each, more than the total "
                    f"budget {num_layers} x {keep} allows; lower protect_layers or raise the budget")
            budgets[:, b] = length
            low = min(max(1, math.ceil(MIN_LAYER_RATIO * length)), rest // int(free.sum()))
            budgets[free, b] = allocate(weights[free, b], rest, low, length)
        return budgets.to(n_keep.device)

    # -- token level ---------------------------------------------------------------------------------

    def observe(self, layer: int, kv: LayerKV, stats: AttentionStats) -> None:
        """H2O accumulation of the newest query's attention."""
        kv.accumulate_step(ATTENTION, stats)

    def compress(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor, phase: str,
                 host: HostSizes | None = None) -> LayerKV:
        if phase == "prefill":
            kv.state[ATTENTION] = stats.column_sums.float().clone()
        keep = per_sample_n_keep(n_keep, kv)  # (B, H)
        sinks, recent = self._protected(keep)
        index, lengths = keep_topk(kv.state[ATTENTION], keep, kv.lengths, sinks=sinks.unsqueeze(-1),
                                   recent=recent.unsqueeze(-1), row_sizes=host and host.most_kept())
        valid = kv.valid()
        kept = torch.zeros_like(valid).scatter_(2, index, True) & valid
        evicted = valid & ~kept
        similarity, match = best_match_cosine(kv.keys, evicted, kept)  # (B, H, T) each
        u = torch.where(evicted, similarity, 0.0)
        threshold = self._threshold(kv, u.sum(-1), evicted.sum(-1).float())  # (B, H)
        merged = evicted & (match >= 0) & (similarity >= threshold.unsqueeze(-1))
        new_slot = kept.long().cumsum(-1) - 1  # compact index of each kept slot
        target = torch.where(kept, new_slot, torch.where(merged, new_slot.gather(2, match.clamp(min=0)), -1))
        own, merged_raw, merged_mass = self._merge_terms(similarity)
        raw = torch.where(kept, own, torch.where(merged, merged_raw, 0.0))
        mass = torch.where(kept, own, torch.where(merged, merged_mass, 0.0))
        norm = group_sum(mass, target, index.shape[-1])  # of each kept slot: its own term + its merged ones
        weight = raw / norm.gather(2, target.clamp(min=0)).clamp(min=1e-12)
        out = kv.gather(index, lengths, host)
        out.keys = scatter_merge(kv.keys, target, weight, index.shape[-1])
        out.values = scatter_merge(kv.values, target, weight, index.shape[-1])
        out.state[THRESHOLD] = threshold.float().unsqueeze(-1).expand(-1, -1, out.capacity).clone()
        out.zero_padding(host)
        return out

    def evict_one(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor) -> None:
        """``compress`` of a row one slot over its budget, in place: the lowest accumulated attention outside
        the sinks and the recent window leaves, merges into its most similar remaining slot when the cosine
        passes the EMA threshold (the only slot whose key and value change), and every slot takes the new
        threshold (``kernels.d2o_step``: four launches with the Triton backend, three after a one-query pass, whose
        appended token holds each row's newest position in its last slot; ``observe_and_evict_one`` makes that
        pass's step attention in the first of them)."""
        self._evict(kv, stats, n_keep)

    def observe_and_evict_one(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor) -> None:
        """``observe`` and ``evict_one`` in one: a step attention still pending is made and accumulated inside the
        step's first launch (with the Triton backend after a one-query pass: the victim's search), not in a
        launch of its own."""
        if ATTENTION in kv.state and stats.step_attention is None and stats.pending_step is not None:
            self._evict(kv, stats, n_keep, step=stats.pending_step)
        else:
            super().observe_and_evict_one(layer, kv, stats, n_keep)

    def _evict(self, kv: LayerKV, stats: AttentionStats, n_keep: Tensor,
               step: Callable[..., Tensor] | None = None) -> None:
        d2o_step(kv.keys, kv.values, kv.positions, kv.lengths, kv.state_storage(), kv.state[ATTENTION],
                 kv.state[THRESHOLD], n_keep, self.n_heavy, self.n_recent, self.n_sinks, self.beta,
                 self.threshold_scope == "layer", self.merge_rule == "weighted", newest_last=stats.one_query,
                 step=step)

    def _protected(self, keep: Tensor) -> tuple[Tensor, Tensor]:
        """(sinks, recent), (B, H) each, of a (B, H) budget: the recent share floored, sinks inside the rest."""
        return protection(keep, self.n_heavy, self.n_recent, self.n_sinks)

    def _threshold(self, kv: LayerKV, total: Tensor, count: Tensor) -> Tensor:
        """This step's EMA threshold (B, H) from each row's sum and number (float) of the similarities u_e of
        its evicted slots; rows without evictions keep the previous one (NaN: none yet)."""
        previous = kv.state[THRESHOLD][:, :, 0] if THRESHOLD in kv.state else torch.full(
            kv.lengths.shape, float("nan"), device=kv.keys.device)
        return ema_threshold(previous, total, count, self.beta, self.threshold_scope == "layer")

    def _merge_terms(self, similarity: Tensor) -> tuple[float, Tensor, Tensor]:
        """The merge rule's weights (``kernels.d2o_step.merge_terms``)."""
        return merge_terms(similarity, self.merge_rule == "weighted")


def prompt_variances(stats: AttentionStats) -> Tensor:
    """(B, H_q) float64: each query head's variance of its prompt column sums (``query_column_sums``) over the
    prompt's real slots, unbiased, as ``torch.var`` in the authors' code."""
    col = stats.query_column_sums.double()
    slots = torch.arange(col.shape[-1], device=col.device).view(1, 1, -1)
    real = slots < stats.num_queries.to(col.device).view(-1, 1, 1)
    count = real.sum(-1)  # (B, H_q)
    mean = (col * real).sum(-1) / count.clamp(min=1)
    squares = ((col - mean.unsqueeze(-1)) ** 2 * real).sum(-1)
    return squares / (count - 1).clamp(min=1)


def allocate(weights: Tensor, total: int, low: int, high: int) -> Tensor:
    """Integer split of ``total`` proportional to ``weights`` (L,), each part clamped to [low, high].

    Finds c with sum_l clamp(c * w_l, low, high) = total by bisection (the sum is monotone in c), then rounds by
    largest remainders so the parts sum to ``total`` exactly (when L * low <= total <= L * high).
    """
    w = weights.double().clamp(min=1e-300)
    lo_c, hi_c = 0.0, float(total) / float(w.min()) + 1.0
    for _ in range(200):
        c = (lo_c + hi_c) / 2
        if float((c * w).clamp(low, high).sum()) < total:
            lo_c = c
        else:
            hi_c = c
    share = (hi_c * w).clamp(low, high)
    parts = share.floor().long()
    missing = max(0, min(total - int(parts.sum()), len(parts)))
    parts[torch.argsort(share - share.floor(), descending=True, stable=True)[:missing]] += 1
    return parts
