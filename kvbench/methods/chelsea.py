"""Chelsea (Hu, Wang et al., "Efficient Long-Context LLM Inference via KV Cache Clustering"), methods.md §5.

Per layer and KV head, the first ``sinks`` and last ``recent`` slots are kept; the slots between them (the
clusterable region) are clustered by Chunked Soft Matching (CSM): the region is cut into chunks of
``chunk_size``, each chunk split alternately into sets A (even offsets) and B (odd offsets), every A slot gets
an edge to its most similar B slot of the chunk (key cosine), and the top edges over all chunks are kept:
``max(1, floor(r * region))`` of them, and never more than the row's excess over its budget, so the last
step lands exactly on the budget. Each B slot and the A slots joined to it become one centroid,
k = sum n_i k_i / sum n_i, v likewise, degree n = sum n_i, placed at the B slot (its position) [I].
Steps repeat until every row fits its budget (one step removes at most half the region).

Budget: ``budget_basis="prompt_plus_generation"``, B = rho * (prompt + max_new_tokens) per head.
Decode: the cache grows by one slot per step and is clustered back to B every ``decode_interval`` steps
(the paper's threshold B + Delta with Delta lost; [I] Delta = 64 = ``recent``), so between two clusterings a
row holds up to B + decode_interval - 1 slots, as in the paper.

Readings (methods.md §5.c/5.g), flagged [I]:
- Keys are the cached post-RoPE keys. The per-slot degree is tracked in ``state["merged_tokens"]``
  (= degree - 1, so that appended tokens start at degree 1).
- Degree bias (``degree_bias=true``, default): the clustered attention of §3 weighs a centroid by its degree
  n_c, i.e. adds log n_c to its logit; the paper never says inference applies it. It is kept as the per-slot
  ``state["logit_bias"] = log(1 + merged_tokens)``, rewritten after every compression call (prefill and each
  decode re-clustering); tokens appended in between get 0 = log 1. With it, a centroid of n identical keys
  takes exactly the attention its n tokens would. ``degree_bias=false`` keeps the degree for merging only.
- Compression-ratio schedule: r_t = max(r0 - r_decay * min(t, r_steps), r_min), t = step index within one
  compression call; the defaults (r0=0.5, r_decay=0, r_steps=0) give the constant ratio the paper uses for
  NIAH. The paper's per-model constants are lost. With r = 0.5 the floor(r * region) kept edges are all the
  edges (one per A slot, half the region): every A slot merges into its best B slot on every step but the
  last, which stops at the budget, so similarity decides only *where* a slot merges, never *whether*.
- [P] The paper's LongBench tables use 4% outlier heads (38.97 with vs 36.46 without);
  ``conf/experiment/chelsea_longbench.yaml`` calibrates them per model before the chelsea runs
  (``chelsea_calibrate.CalibrateOutlierHeads``).
- If a budget cannot hold sinks + recent + 1 slots, the windows shrink for that row (recent first kept,
  then sinks), so the budget always holds.
- Outlier heads (``outlier_heads_file``, written by ``python -m kvbench.methods.chelsea_calibrate``) keep a
  full cache. Budget reallocation (App. C.2): with H heads in all (layers x KV heads) and H_o outliers,
  normal heads get B' = floor((H * B - H_o * T) / (H - H_o)), clamped to [1, B], where T = prompt length +
  max_new_tokens: outlier heads are charged the full cache they hold at the end of generation.

Cost: no attention statistics (FlashAttention-compatible; with ``degree_bias`` the engine attends through its
ragged path, which adds the per-slot bias, instead of the wrapped FlashAttention/SDPA kernel). One CSM step
over a region of m slots costs O(m * chunk_size * d / 4) for the in-chunk cosines, O(m log m) for ranking
edges and O(m d) for the merge; prefill runs about log_{1/(1-r)}(m / B) steps; decode runs one step on about
B + decode_interval slots every decode_interval steps, i.e. O(B * chunk_size * d / (4 * decode_interval)) per
generated token. Ranking (a sort) only runs on a step that merges fewer than all edges (with r = 0.5, the last).
Host cost: a compression call reads the row lengths back once and plans every step on the host
(``chelsea_schedule``: merge counts depend on lengths alone), so the steps run without read-backs; on CUDA a
step is one Triton launch for the matching and two for the merge (``kernels.partner_merge``), plus a sort
on a ranking step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from kvbench.errors import ConfigError
from kvbench.kernels.matching import chunked_soft_matching
from kvbench.kernels.partner_merge import merge_into_partners
from kvbench.kernels.select import topk_mask
from kvbench.kv import LOGIT_BIAS, AttentionStats, HostSizes, LayerKV
from kvbench.methods.base import Method
from kvbench.methods.chelsea_schedule import DeviceStep, plan_step, plan_steps, upload

MERGED = "merged_tokens"  # per-slot state: original tokens merged into the slot besides its own (degree - 1)


@dataclass
class Chelsea(Method):
    """sinks, recent: protected slots; chunk_size: CSM chunk (null = no chunking); r0, r_decay, r_steps,
    r_min: compression-ratio schedule; outlier_heads_file: calibration JSON (null = no outlier heads);
    degree_bias: add log(degree) to every slot's attention logit [I]."""

    name: ClassVar[str] = "chelsea"
    phases: ClassVar[frozenset[str]] = frozenset({"prefill", "decode"})
    budget_basis: ClassVar[str] = "prompt_plus_generation"

    sinks: int = 16
    recent: int = 64
    chunk_size: int | None = 256
    r0: float = 0.5
    r_decay: float = 0.0
    r_steps: int = 0
    r_min: float = 0.1
    outlier_heads_file: str | None = None
    degree_bias: bool = True
    compress_during_decode: bool = True
    decode_interval: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sinks < 0 or self.recent < 0:
            raise ConfigError(f"{self.name}: sinks={self.sinks}, recent={self.recent} must be >= 0")
        if self.chunk_size is not None and self.chunk_size < 2:
            raise ConfigError(f"{self.name}: chunk_size={self.chunk_size}; accepted: an integer >= 2 or null")
        if not 0 < self.r0 <= 0.5:
            raise ConfigError(f"{self.name}: r0={self.r0} must be in (0, 0.5] (a CSM step removes at most half)")
        if not 0 <= self.r_min <= self.r0:
            raise ConfigError(f"{self.name}: r_min={self.r_min} must be in [0, r0={self.r0}]")
        if self.r_decay < 0 or self.r_steps < 0:
            raise ConfigError(f"{self.name}: r_decay={self.r_decay}, r_steps={self.r_steps} must be >= 0")
        self._outliers = load_outlier_heads(self.outlier_heads_file)

    def ratio(self, step: int) -> float:
        """Compression ratio r_t of clustering step ``step`` (0-based) within one compression call."""
        return max(self.r0 - self.r_decay * min(step, self.r_steps), self.r_min)

    def layer_budgets(
        self, n_keep: Tensor, num_layers: int, prefill_stats: list[AttentionStats], max_new_tokens: int
    ) -> Tensor:
        """(B,) -> (L, B): B' for the normal heads of every layer (outlier heads ignore it)."""
        budgets = super().layer_budgets(n_keep, num_layers, prefill_stats, max_new_tokens)
        if self._outliers is None:
            return budgets
        shape = self._outliers["shape"]
        if shape[0] != num_layers:
            raise ConfigError(f"{self.name}: outlier_heads_file {self.outlier_heads_file} is for {shape[0]} "
                              f"layers; this model has {num_layers}")
        total, n_out = shape[0] * shape[1], len(self._outliers["heads"])
        if n_out == total:
            return budgets
        full_cache = prefill_stats[0].num_queries.to(n_keep) + max_new_tokens  # what an outlier head ends with
        normal = torch.div(total * n_keep - n_out * full_cache, total - n_out, rounding_mode="floor")
        return torch.minimum(normal.clamp(min=1), n_keep).unsqueeze(0).expand(num_layers, -1).clone()

    def compress(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor, phase: str,
                 host: HostSizes | None = None) -> LayerKV:
        if MERGED not in kv.state:
            kv.state[MERGED] = torch.zeros(kv.positions.shape, device=kv.keys.device)
        if host is None:  # the one read-back of the call
            H = kv.lengths.shape[1]
            sizes = torch.cat([kv.lengths, n_keep.to(kv.lengths).view(-1, 1)], 1).cpu().numpy()
            host = HostSizes(n_keep=sizes[:, H], lengths=sizes[:, :H])
        lengths, target = host.lengths, self.target(layer, host)
        for step in upload(plan_steps(lengths, target, self.sinks, self.recent, self.chunk_size, self.ratio),
                           kv.keys.device):
            kv = self.run_step(kv, step)
        if self.degree_bias:
            kv.state[LOGIT_BIAS] = torch.log1p(kv.state[MERGED].float())
        return kv

    def kept_lengths(self, layer: int, host: HostSizes) -> np.ndarray:
        """Every row merged down to its target (``plan_step`` never merges a row past it)."""
        return np.minimum(host.lengths, self.target(layer, host))

    def target(self, layer: int, host: HostSizes) -> np.ndarray:
        """Host (B, H) per-row targets: the budget, or the length on outlier heads (they stay full)."""
        return np.where(self.outlier_rows(layer, host.lengths.shape[1]), host.lengths, host.n_keep[:, None])

    def outlier_rows(self, layer: int, heads: int) -> np.ndarray:
        """(heads,) bool: KV heads of this layer that keep a full cache."""
        rows = np.zeros(heads, dtype=bool)
        if self._outliers is None:
            return rows
        if self._outliers["shape"][1] != heads:
            raise ConfigError(f"{self.name}: outlier_heads_file {self.outlier_heads_file} is for "
                              f"{self._outliers['shape'][1]} KV heads per layer; this model has {heads}")
        for out_layer, head in self._outliers["heads"]:
            if out_layer == layer:
                rows[head] = True
        return rows

    def cluster_step(self, kv: LayerKV, target: Tensor, r: float) -> LayerKV:
        """One CSM step at ratio ``r`` on every row above its ``target`` (B, H); returns the re-allocated cache."""
        host = torch.cat([kv.lengths, target.to(kv.lengths)], 1).cpu().numpy()
        H = kv.lengths.shape[1]
        step = plan_step(host[:, :H], host[:, H:], self.sinks, self.recent, self.chunk_size, r)
        return self.run_step(kv, upload([step], kv.keys.device)[0])

    def run_step(self, kv: LayerKV, step: DeviceStep) -> LayerKV:
        """The device work of a planned step: edges, the planned number of the best ones, their merge."""
        partner, similarity = chunked_soft_matching(kv.keys, step.start, step.region, self.chunk_size,
                                                    step.longest_region)
        # A slots merged into their B slot: every edge (-inf marks none), or each row's best ``merges`` (a sort)
        absorbed = similarity > -float("inf") if step.every_edge else topk_mask(similarity, step.merges)
        keys, values, positions, merged, source = merge_into_partners(
            kv.keys, kv.values, kv.positions, kv.state[MERGED], kv.lengths, absorbed, partner, step.longest_row)
        out = LayerKV(keys=keys, values=values, positions=positions, lengths=step.lengths,
                      state={MERGED: merged}, tables=kv.tables)
        for name, state in kv.state.items():  # other states follow their survivor
            if name != MERGED:
                out.state[name] = state.gather(2, source).masked_fill_(~out.valid(), 0)
        return out


def load_outlier_heads(path: str | None) -> dict | None:
    """Read the calibration JSON: {"num_layers": L, "num_key_value_heads": H, "outlier_heads": [[l, h], ...]}."""
    if path is None:
        return None
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"chelsea: outlier_heads_file '{path}' does not exist; accepted: a calibration JSON "
                          "written by `python -m kvbench.methods.chelsea_calibrate`, or null")
    data = json.loads(file.read_text())
    try:
        shape = (int(data["num_layers"]), int(data["num_key_value_heads"]))
        heads = sorted({(int(layer), int(head)) for layer, head in data["outlier_heads"]})
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"chelsea: outlier_heads_file '{path}' is malformed ({err!r}); expected keys "
                          "num_layers, num_key_value_heads, outlier_heads = [[layer, kv_head], ...]") from err
    bad = [pair for pair in heads if not (0 <= pair[0] < shape[0] and 0 <= pair[1] < shape[1])]
    if bad:
        raise ConfigError(f"chelsea: outlier heads {bad} in '{path}' are outside {shape[0]} layers x "
                          f"{shape[1]} KV heads")
    return {"shape": shape, "heads": heads}
