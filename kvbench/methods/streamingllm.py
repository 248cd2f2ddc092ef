"""StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks").

Keep the first ``sinks`` tokens (attention sinks) plus the most recent tokens; evict everything in between.
No attention statistics are needed. As the merging papers run it (methods.md 6.2): 4 sinks [P: Chelsea,
WeightedKV; std], applied after prefill and at every decode step [P: EMS, "compress during both prefilling
and decoding"].

Interpretations:
- [I] The recent window is the rest of the per-head budget: ``recent = n_keep - sinks``, per sample.
- [I] A budget smaller than ``sinks`` keeps the first ``n_keep`` tokens (all of it goes to sinks).
- [I] Sinks are the oldest slots still in the row; after prefill they are the first prompt tokens, and
  StreamingLLM never evicts them, so they stay the first tokens for the whole generation.
- [I] Positions: the paper uses positions *within the cache* (keys are cached before RoPE and rotated by
  their current cache index at every step, so sinks and window are always contiguous positions 0..n-1).
  kvbench's engine does not re-rotate cached keys: ``position_mode=original`` (default) keeps every token at
  its original position; ``position_mode=cache_length`` gives *new* tokens the row's cache length as position
  while cached keys keep their original rotation, so neither mode reproduces the paper's in-cache positions.
  This matters once a generation runs past the model's trained context length (the paper's streaming
  setting); within it, original positions are what the merging papers' baselines use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvbench.kernels.select import keep_topk, sinks_and_recent
from kvbench.kv import AttentionStats, HostSizes, LayerKV
from kvbench.methods.base import Method, check_count, per_sample_n_keep


@dataclass
class StreamingLLM(Method):
    """sinks: attention-sink tokens kept at the start of every row (paper default 4)."""

    name: ClassVar[str] = "streamingllm"
    keeps_exact_budget: ClassVar[bool] = True
    phases: ClassVar[frozenset[str]] = frozenset({"prefill", "decode"})
    evicts_in_place: ClassVar[bool] = True

    sinks: int = 4
    compress_during_decode: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_count(self.name, 0, sinks=self.sinks)

    def compress(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor, phase: str,
                 host: HostSizes | None = None) -> LayerKV:
        keep = per_sample_n_keep(n_keep, kv)  # (B, H)
        sinks, recent = sinks_and_recent(keep, self.sinks)
        # Every kept slot is protected (sinks + recent = n_keep), so the scores never decide anything.
        scores = torch.zeros(kv.positions.shape, device=kv.keys.device)
        index, lengths = keep_topk(scores, keep, kv.lengths, sinks=sinks, recent=recent,
                                   row_sizes=host and host.most_kept())
        return kv.gather(index, lengths, host)

    def evict_one(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor) -> None:
        """Drop the oldest token after the sinks (a ring buffer after them); a budget within the sinks drops
        the newest. Sinks stay in the slots prefill put them in (they are never dropped or moved)."""
        kv.evict_in_budget(None, n_keep, self.sinks, None)

