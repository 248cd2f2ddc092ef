"""CaM, Cache Merging (Zhang et al., ICML 2024, "CaM: Cache Merging for Memory-efficient LLMs Inference").

A preliminary eviction policy picks the tokens to evict; instead of dropping them outright, CaM merges the
*value* of each to-be-evicted token into the values of the tokens that stay. Keys of evicted tokens are
dropped. Applied after the prompt and at every decode step (one eviction per new token).

Rule (methods.md 6.5; WeightedKV §II; the authors' code, github.com/zyxxmu/cam: the StreamingLLM-based
``generate_task/streaming_llm/kv_cache_cam.py``, which processes a prompt token by token like a generation):
- eviction: StreamingLLM, 4 sinks + recent window (as Chelsea and EMS run CaM, "consistent with the original
  paper"); ``eviction="h2o"`` switches to H2O (accumulated attention, half heavy / half recent, sinks taken
  from the heavy share).
- one merge per evicted token: when e leaves, its value is added to the next ``merge_tokens`` (n) slots of
  the cache at that moment, the slots right after it, each receiving m_e * x_e / n (the constant factor 1/n
  of WeightedKV's description; the code's ``merge_num = 16``); x_e is e's value including what earlier
  evictions added to it, so value mass moves forward token by token (as the code's in-place ``+=`` does).
- merge probability p_e = min(1, a_e / mean_{t in targets} a_t), a = accumulated attention (prompt column
  sums, then + each decode query's attention), as the code's ``accum_attn``.
- merge mask m_e ~ Bernoulli(p_e): m_e = [u_e < p_e] with u_e a counter-based hash of (seed, layer, KV head,
  e's position, the row's newest position) (``uniform_draws``), so a compression is a pure function of its
  inputs and a slot's draw depends neither on the slot order (the in-place decode step) nor on the batch;
  ``deterministic=True`` uses the expectation m_e = p_e.

Prefill: evict as the policy does (StreamingLLM: every slot between the sinks and the recent window), then
merge the evicted tokens one at a time in positional order (oldest first), as the authors' code does when it
feeds a prompt: each into the n slots after it, including slots evicted later, which carry the mass on.
Decode: one eviction and one merge per generated token (``decode_interval=1``, in place: ``evict_one``); a
pass that evicts several tokens merges them in the same order.

Interpretations:
- [I] The prompt is encoded in one pass with full attention, so a is the prompt's column sums over all its
  queries; the authors' streaming code accumulates, at the time e leaves, the attention of the queries so
  far, each over the streaming cache. The authors' other prompt path (``cam_hf/utils_lm_eval``, a masked
  simulation) spreads over the whole recent window and divides by the largest score among sinks and window;
  its generation path (``cam_hf/utils_hh``) does not merge the prompt at all. kvbench follows the
  StreamingLLM code, the one that keeps a real compressed cache.
- [I] H2O eviction: the evicted set is chosen at once; merging still runs oldest first into the next n slots.
- [I] When fewer than n slots follow e, only those receive m_e x_e / n (the rest of its mass is lost, as the
  code's slice ``start:start+merge_num`` is cut at the cache end), and p_e uses the mean over those that exist.
- [I] A target window whose mean accumulated attention is 0 gives p_e = 1 if a_e > 0, else 0 (the code maps
  0/0 to 0).
- [I] Per key/value head: attention of the query heads of a GQA group is averaged by the engine.

Cost per compression of a row of T slots (head dim d, n targets, S = ``CASCADE_BLOCK``): selection
O(T log T); the cascade x_s = v_s + sum over j in [s - n, s) of m_j x_j / n (m = 0 on slots that stay), a
banded triangular system over the row's slots whose solution is every slot's final value, solved in blocks
of S at once and carried across blocks (``kernels.cascade``): O(T S (d + n) + T n (n + d)), a handful of
batched operations and no loop over the row; the window scores O(n T), at every call. A decode step in place
(``evict_one``): O(T) for the victim, O(n T) for its n next positions (n scans of the row, in the fused
kernel), O(n d) for the merge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvbench.errors import ConfigError
from kvbench.kernels.cam_step import cam_step, draw_key, merge_probability, uniform_draws
from kvbench.kernels.cascade import banded_cascade
from kvbench.kernels.dispatch import use_triton
from kvbench.kernels.select import heavy_split, keep_topk, sinks_and_recent
from kvbench.kv import AttentionStats, HostSizes, LayerKV
from kvbench.methods.base import Method, check_unit_interval, per_sample_n_keep
from kvbench.methods.base import check_count

ATTENTION = "attention"
EVICTIONS = ("streamingllm", "h2o")


@dataclass
class CaM(Method):
    """sinks: first tokens never evicted. merge_tokens: n, the slots after an evicted one that share its
    value. eviction: the preliminary policy. heavy_ratio: H2O's heavy share (eviction="h2o" only).
    seed: Bernoulli mask seed. deterministic: use the merge probability itself instead of a sampled mask."""

    name: ClassVar[str] = "cam"
    keeps_exact_budget: ClassVar[bool] = True
    needs: ClassVar[frozenset[str]] = frozenset({"column_sums"})
    decode_needs: ClassVar[frozenset[str]] = frozenset({"step_attention"})
    phases: ClassVar[frozenset[str]] = frozenset({"prefill", "decode"})
    evicts_in_place: ClassVar[bool] = True

    sinks: int = 4
    merge_tokens: int = 16
    eviction: str = "streamingllm"
    heavy_ratio: float = 0.5
    seed: int = 0
    deterministic: bool = False
    compress_during_decode: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_count(self.name, 0, sinks=self.sinks, seed=self.seed)
        check_count(self.name, 1, merge_tokens=self.merge_tokens)
        check_unit_interval(self.name, heavy_ratio=self.heavy_ratio)
        if self.eviction not in EVICTIONS:
            raise ConfigError(f"cam: unknown eviction '{self.eviction}'; accepted: {', '.join(EVICTIONS)}")

    def observe(self, layer: int, kv: LayerKV, stats: AttentionStats) -> None:
        """Accumulate the newest query's attention."""
        kv.accumulate_step(ATTENTION, stats)

    def compress(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor, phase: str,
                 host: HostSizes | None = None) -> LayerKV:
        if phase == "prefill":
            kv.state[ATTENTION] = stats.column_sums.float().clone()
        attention = kv.state[ATTENTION]  # (B, H, T)
        keep = per_sample_n_keep(n_keep, kv)  # (B, H)
        index, lengths = self._select(attention, keep, kv.lengths, host and host.most_kept())
        valid = kv.valid()
        kept = torch.zeros_like(valid).scatter_(2, index, True) & valid
        evicted = valid & ~kept
        share = self._shares(layer, kv, attention, evicted)  # m_e / n, (B, H, T)
        # every real slot's final value: evicted ones carry x_e on when they leave, kept ones (share 0) keep it
        held = evicted_values(kv.values.float(), share, valid, self.merge_tokens)  # (B, H, T, D)
        out = kv.gather(index, lengths)
        out.values = held.gather(2, index.unsqueeze(-1).expand_as(out.values)).to(kv.values.dtype)
        out.zero_padding()
        return out

    def evict_one(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor) -> None:
        """``compress`` of a row one slot over its budget, in place: the slot the policy drops adds m_e v_e / n
        to the values of the slots holding the next n positions, and leaves; keys and scores stay
        (``kernels.cam_step``: three or four launches with the Triton backend; after a one-query pass, whose
        appended token holds each row's newest position in its last slot, no scan for it)."""
        cam_step(kv.keys, kv.values, kv.positions, kv.lengths, kv.state_storage(), kv.state[ATTENTION], n_keep,
                 self.sinks, None if self.eviction == "streamingllm" else self.heavy_ratio, self.merge_tokens,
                 None if self.deterministic else draw_key(self.seed, layer), newest_last=stats.one_query)

    def _select(self, attention: Tensor, keep: Tensor, lengths: Tensor,
                row_sizes: list[int] | None = None) -> tuple[Tensor, Tensor]:
        """The preliminary eviction: (index (B, H, K), new lengths (B, H)) as ``keep_topk`` returns them."""
        if self.eviction == "streamingllm":
            sinks, recent = sinks_and_recent(keep, self.sinks)
            return keep_topk(torch.zeros_like(attention), keep, lengths, sinks=sinks, recent=recent,
                             row_sizes=row_sizes)
        sinks, recent = heavy_split(keep, self.heavy_ratio, self.sinks)
        return keep_topk(attention, keep, lengths, sinks=sinks, recent=recent, row_sizes=row_sizes)

    def _shares(self, layer: int, kv: LayerKV, attention: Tensor, evicted: Tensor) -> Tensor:
        """(B, H, T) m_e / n of the evicted slots of a position-ordered cache, 0 elsewhere (one launch with the
        Triton twin, ``kernels.triton_cam``; bit-identical)."""
        if use_triton("cam_merge_shares", attention):
            from kvbench.kernels import triton_cam

            newest = torch.where(kv.valid(), kv.positions, -1).amax(-1)
            return triton_cam.merge_shares(attention, kv.lengths, kv.positions, evicted, newest, self.merge_tokens,
                                           None if self.deterministic else draw_key(self.seed, layer))
        prob = self._merge_probabilities(kv, attention, evicted)
        return self._merge_mask(layer, kv, prob, kv.positions) / self.merge_tokens

    def _merge_probabilities(self, kv: LayerKV, attention: Tensor, evicted: Tensor) -> Tensor:
        """(B, H, T) p_e on evicted slots (0 without a target), 0 elsewhere; slots in positional order."""
        n = self.merge_tokens
        slots = torch.arange(kv.capacity, device=attention.device).view(1, 1, -1)
        count = (kv.lengths.unsqueeze(-1) - 1 - slots).clamp(min=0, max=n)  # real slots among the next n
        total = torch.zeros_like(attention)
        real = torch.where(kv.valid(), attention, 0.0)
        for offset in range(1, min(n, kv.capacity - 1) + 1):
            total[..., :-offset] += real[..., offset:]
        return torch.where(evicted, merge_probability(attention, total, count), 0.0)

    def _merge_mask(self, layer: int, kv: LayerKV, prob: Tensor, position: Tensor) -> Tensor:
        """m_e (a 0/1 draw, or the probability itself if deterministic) of slots holding ``position`` with
        merge probability ``prob`` (both (B, H, k)), drawn as of the row's newest position."""
        if self.deterministic:
            return prob
        newest = torch.where(kv.valid(), kv.positions, -1).amax(-1, keepdim=True)  # (B, H, 1)
        head = torch.arange(kv.lengths.shape[1], device=prob.device).view(1, -1, 1)
        return (uniform_draws(draw_key(self.seed, layer), head, position, newest) < prob).float()


CASCADE_BLOCK = 64  # slots per diagonal block of ``evicted_values``'s solve (``kernels.cascade``)


def evicted_values(values: Tensor, share: Tensor, slots: Tensor, n: int) -> Tensor:
    """(B, H, T, D) float32: x_e = v_e + sum over ``slots`` j in [e - n, e) of share_j x_j on the slots e of
    ``slots`` (B, H, T) bool, 0 elsewhere. With ``slots`` the evicted slots, x_e is what e holds when it leaves
    (oldest first); ``compress`` passes every real slot, with share 0 on those that stay, so that a kept slot's
    x is its final value. The banded recurrence of ``kernels.cascade.banded_cascade``, in blocks of
    ``CASCADE_BLOCK`` slots."""
    x = banded_cascade(torch.where(slots.unsqueeze(-1), values, 0.0), torch.where(slots, share, 0.0), n,
                       CASCADE_BLOCK)
    return torch.where(slots.unsqueeze(-1), x, 0.0)
