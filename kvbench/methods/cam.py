"""CaM, Cache Merging (Zhang et al., ICML 2024, "CaM: Cache Merging for Memory-efficient LLMs Inference").

A preliminary eviction policy picks the tokens to evict; instead of dropping them outright, CaM merges the
*value* of each to-be-evicted token into the values of the tokens that stay. Keys of evicted tokens are
dropped. Applied after the prompt and at every decode step (one eviction per new token).

Rule (methods.md 6.5; WeightedKV §II; the authors' StreamingLLM code ``kv_cache_cam.py``):
- eviction: StreamingLLM, 4 sinks + recent window (as Chelsea and EMS run CaM, "consistent with the original
  paper"); ``eviction="h2o"`` switches to H2O (accumulated attention, half heavy / half recent, sinks taken
  from the heavy share).
- merge targets of an evicted token e: the next ``merge_tokens`` (n) *kept* tokens after e, in order.
- merge probability p_e = min(1, a_e / mean_{t in targets} a_t), a = accumulated attention (prompt column
  sums, then + each decode query's attention). The authors' code uses the accumulated attention too.
- merge mask m_e ~ Bernoulli(p_e) from a generator seeded by (seed, layer, current token index), so a
  compression is a pure function of its inputs; ``deterministic=True`` uses the expectation m_e = p_e.
- every target gets v_t += m_e * v_e / n (the constant factor 1/n of WeightedKV's description).

Interpretations:
- [I] At prefill all evicted tokens merge at once into the next n kept tokens; with StreamingLLM eviction
  they all land on the first n recent tokens. (The token-by-token streaming version would cascade merges
  through tokens that are evicted later; one-shot prefill compression has no such order.)
- [I] When fewer than n kept tokens follow e, only those receive v_e / n (the rest of its mass is lost), and
  p_e uses the mean over those that exist.
- [I] A target whose mean accumulated attention is 0 gives p_e = 1 if a_e > 0, else 0 (the code maps 0/0 to 0).
- [I] Per key/value head: attention of the query heads of a GQA group is averaged by the engine.

Cost per compression of a row of T slots (K kept, E evicted, head dim d): selection O(T log T), merge
O((T + K) d) (one scatter of evicted values by target start, then a length-n window sum over kept slots).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from kvbench.errors import ConfigError
from kvbench.kernels.merge import scatter_merge
from kvbench.kernels.select import keep_topk
from kvbench.kv import AttentionStats, LayerKV
from kvbench.methods.base import Method, check_unit_interval, per_sample_n_keep
from kvbench.methods.base import check_count
from kvbench.methods.streamingllm import sinks_and_recent

ATTENTION = "attention"
EVICTIONS = ("streamingllm", "h2o")


@dataclass
class CaM(Method):
    """sinks: first tokens never evicted. merge_tokens: n, the kept tokens after an evicted one that share its
    value. eviction: the preliminary policy. heavy_ratio: H2O's heavy share (eviction="h2o" only).
    seed: Bernoulli mask seed. deterministic: use the merge probability itself instead of a sampled mask."""

    name: ClassVar[str] = "cam"
    needs: ClassVar[frozenset[str]] = frozenset({"column_sums"})
    decode_needs: ClassVar[frozenset[str]] = frozenset({"step_attention"})
    phases: ClassVar[frozenset[str]] = frozenset({"prefill", "decode"})

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
        kv.accumulate(ATTENTION, stats.step_attention)

    def compress(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor, phase: str) -> LayerKV:
        if phase == "prefill":
            kv.state[ATTENTION] = stats.column_sums.float().clone()
        attention = kv.state[ATTENTION]  # (B, H, T)
        keep = per_sample_n_keep(n_keep, kv)  # (B, H)
        index, lengths = self._select(attention, keep, kv.lengths)
        valid = kv.valid()
        kept = torch.zeros_like(valid).scatter_(2, index, True) & valid
        evicted = valid & ~kept
        # Kept slots before e = compact index of the first kept slot after e = start of e's targets.
        first_target = kept.long().cumsum(-1)
        mask = self._merge_mask(layer, kv, attention, index, lengths, first_target, evicted)
        K = index.shape[-1]
        target = torch.where(mask > 0, first_target, torch.full_like(first_target, -1))
        # Value mass starting at each kept slot, then a sliding sum over n slots spreads it to slots k..k+n-1.
        starts = scatter_merge(kv.values.float(), target, mask / self.merge_tokens, K)  # (B, H, K, D)
        window = starts.cumsum(2)
        window[:, :, self.merge_tokens:] -= window[:, :, :-self.merge_tokens].clone()
        out = kv.gather(index, lengths)
        out.values = (out.values.float() + window).to(kv.values.dtype)
        out.zero_padding()
        return out

    def _select(self, attention: Tensor, keep: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """The preliminary eviction: (index (B, H, K), new lengths (B, H)) as ``keep_topk`` returns them."""
        if self.eviction == "streamingllm":
            sinks, recent = sinks_and_recent(keep, self.sinks)
            return keep_topk(torch.zeros_like(attention), keep, lengths, sinks=sinks, recent=recent)
        heavy = torch.floor(self.heavy_ratio * keep.double()).long()
        sinks, recent = heavy.clamp(max=self.sinks).unsqueeze(-1), (keep - heavy).unsqueeze(-1)
        return keep_topk(attention, keep, lengths, sinks=sinks, recent=recent)

    def _merge_mask(self, layer: int, kv: LayerKV, attention: Tensor, index: Tensor, lengths: Tensor,
                    first_target: Tensor, evicted: Tensor) -> Tensor:
        """(B, H, T) float: m_e (0/1 sample or probability) on evicted slots that have a target, 0 elsewhere."""
        K = index.shape[-1]
        in_row = torch.arange(K, device=index.device).view(1, 1, -1) < lengths.unsqueeze(-1)
        kept_attention = torch.where(in_row, attention.gather(2, index), 0.0)
        prefix = F.pad(kept_attention.cumsum(-1), (1, 0))  # (B, H, K + 1)
        start = first_target.clamp(max=K)
        stop = torch.minimum(first_target + self.merge_tokens, lengths.unsqueeze(-1)).clamp(min=start)
        count = stop - start
        mean = (prefix.gather(2, stop) - prefix.gather(2, start)) / count.clamp(min=1)
        ratio = torch.where(mean > 0, attention / mean.clamp(min=torch.finfo(torch.float32).tiny),
                            (attention > 0).float())
        prob = torch.where(evicted & (count > 0), ratio.clamp(0, 1), 0.0)
        if self.deterministic:
            return prob
        generator = torch.Generator(device=prob.device)
        generator.manual_seed(self._draw_seed(layer, kv))
        return torch.bernoulli(prob, generator=generator)

    def _draw_seed(self, layer: int, kv: LayerKV) -> int:
        """Seed of one compression: the run's seed, the layer and the newest token index (the decode step)."""
        step = int(kv.positions.max()) if kv.positions.numel() else 0
        return (self.seed * 1_000_003 + layer * 10_007 + step) % (2**63)
