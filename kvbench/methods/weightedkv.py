"""WeightedKV (Yuan, He, Bai, Leng, Jiang, "WeightedKV: Attention Scores Weighted Key-Value Cache Merging for
LLMs"). methods.md §4.

Per KV head, two running statistics per slot: a = accumulated attention and n = number of queries that saw
the slot (prompt: column sums and the number of prompt queries at or after the slot; every later pass adds its
queries' summed attention to a and the number of its queries that could see the slot to n, ``observe``: 1 per
decode step, q for a pass that feeds q tokens at once, as Algorithm 1 adds 1 per query). Whenever a row holds
more than its budget m:
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
  ties to the earlier slot, exactly the sequence of argmins. A deleted slot merges into the nearest slot on
  its right that is still there at that time, as the sequential rule does; ``merge_in_order`` computes the
  outcome of all (len - m) merges at once (see its docstring), without a per-token loop.
- [I] A slot never observed (n = 0, e.g. a suffix fed without statistics) has no average yet: it is merged
  only after every observed slot of the region.
- [I] Weights with a_bar[j] + a_bar[r] = 0 fall back to 1/2 each.
- [I] GQA: the engine averages the attention of the query heads of each KV group.

Cost: prefill O(T log T) per row for the merge tree (one sort, a sparse table and pointer doubling, each
log T vectorised passes) plus O(T d) for one scatter of the values; decode, one merge per step: O(T) for
the argmin and the next position and O(d) for the merge, in place (``evict_one``; ``merge_into_right``, a loop
over the row's few excess slots, when a row is further over budget), 2 scalars of state per slot. A decode
merge touches two slots only, so the pairwise convex combination is applied directly rather than through
``scatter_merge`` (a full-row scatter per merge would cost O(T d)).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from kvbench.kernels.dispatch import use_triton
from kvbench.kernels.observe import observe_pass
from kvbench.kernels.select import keep_topk
from kvbench.kernels.weightedkv_step import (average_attention, merge_key, pair_fraction, protection,
                                             weightedkv_step)
from kvbench.kv import AttentionStats, HostSizes, LayerKV
from kvbench.methods.base import Method, check_count, per_sample_n_keep, prompt_observers

ACCUMULATED = "accumulated_attention"  # a
OBSERVED = "observations"  # n


@dataclass
class WeightedKV(Method):
    """sinks: first tokens never merged (paper 4). recent: newest tokens never merged (paper 508 / 124 for
    m = 1024 / 256; None = m / 2 - sinks, the paper's proportion)."""

    name: ClassVar[str] = "weightedkv"
    keeps_exact_budget: ClassVar[bool] = True
    needs: ClassVar[frozenset[str]] = frozenset({"column_sums"})
    decode_needs: ClassVar[frozenset[str]] = frozenset({"step_attention"})
    phases: ClassVar[frozenset[str]] = frozenset({"prefill", "decode"})
    evicts_in_place: ClassVar[bool] = True

    sinks: int = 4
    recent: int | None = None
    compress_during_decode: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_count(self.name, 0, sinks=self.sinks)
        if self.recent is not None:
            check_count(self.name, 0, recent=self.recent)

    def observe(self, layer: int, kv: LayerKV, stats: AttentionStats) -> None:
        """a += the pass's summed attention; n += the number of its queries that could see the slot (in place,
        ``kernels.observe``: one launch with the Triton backend; one query a row, as a decode step has, counts as
        one without reading the positions)."""
        observe_pass(kv.state[ACCUMULATED], kv.state[OBSERVED], stats.step(), kv.positions, kv.lengths,
                     None if stats.one_query else stats.num_queries)

    def compress(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor, phase: str,
                 host: HostSizes | None = None) -> LayerKV:
        if phase == "prefill":
            kv.state[ACCUMULATED] = stats.column_sums.float().clone()
            kv.state[OBSERVED] = prompt_observers(kv)
        keep = per_sample_n_keep(n_keep, kv)  # (B, H)
        excess = kv.lengths - keep  # merges each row needs
        most = int(excess.max()) if host is None else int((host.lengths - host.kept()).max())
        if most <= 0:
            return kv
        average = average_attention(kv.state[ACCUMULATED], kv.state[OBSERVED])  # a_bar, (B, H, T)
        order = self._merge_order(kv, keep, average)
        merge = merge_in_order if phase == "prefill" else merge_into_right
        values, alive = merge(kv.values, average, order, excess)
        index, lengths = keep_topk(alive.float(), keep, kv.lengths,  # survivors, in order
                                   row_sizes=host and host.most_kept())
        return replace(kv, values=values).gather(index, lengths, host)

    def evict_one(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor) -> None:
        """``compress`` of a row one slot over its budget, in place: the region's lowest a_bar (ties: the oldest)
        merges its value into the slot of the next position and leaves; a and n of the others stay
        (``kernels.weightedkv_step``: three or four launches with the Triton backend). A one-query pass (a decode
        step) has just appended its token after each row's last slot: the row's newest position is there, not
        scanned for."""
        weightedkv_step(kv.keys, kv.values, kv.positions, kv.lengths, kv.state_storage(), kv.state[ACCUMULATED],
                        kv.state[OBSERVED], n_keep, self.sinks, self.recent, newest_last=stats.one_query)

    def _protected(self, keep: Tensor) -> tuple[Tensor, Tensor]:
        """(sinks, recent), (B, H) each, of a (B, H) budget m: sinks + recent <= m - 1 (module docstring)."""
        return protection(keep, self.sinks, self.recent)

    def _merge_order(self, kv: LayerKV, keep: Tensor, average: Tensor) -> Tensor:
        """(B, H, T) slots sorted by merge order: region slots by ascending a_bar (never-observed ones last),
        then everything else; each row merges its first ``len - keep`` entries."""
        sinks, recent = self._protected(keep)
        slots = torch.arange(kv.capacity, device=kv.keys.device).view(1, 1, -1)
        region = (slots >= sinks.unsqueeze(-1)) & (slots < (kv.lengths - recent).unsqueeze(-1))
        key = torch.where(region, merge_key(average, kv.state[OBSERVED]), float("inf"))
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
        f = pair_fraction(average.gather(2, j), average.gather(2, r))
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


def merge_in_order(values: Tensor, average: Tensor, order: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
    """``merge_into_right``'s result without its loop: all ``count`` merges of a row at once, O(T log T).

    Slot j = order[i] (i < count) is deleted at time i; the others survive (time T). When j goes it merges
    into r(j) = the first slot right of j deleted later (the nearest survivor at that time), a next-greater-
    element query answered with a sparse table of range maxima and binary lifting. With f_j = a_j / (a_j +
    a_r) (1/2 when both are 0), merges form a forest (parent r(j)) whose roots are the survivors, and each
    original value reaches its root with the product of
      - own(i) = prod over i's children c of (1 - f_c)   (every merge into i scales what i holds), and
      - along each edge j -> r: f_j * prod over r's children merged after j of (1 - f_c)
        (suffix products among siblings in time order);
    path products come from pointer doubling, and the final values are one scatter-add of coefficient x value.
    Same arguments and returns as ``merge_into_right``; values agree with it to float rounding.
    """
    B, H, T, D = values.shape
    device = values.device
    slots = torch.arange(T, device=device).view(1, 1, -1).expand(B, H, T)
    rank = torch.empty_like(order).scatter_(2, order, slots.contiguous())  # deletion time of every slot
    deleted = rank < count.unsqueeze(-1)
    time = torch.where(deleted, rank, T)
    parent = torch.where(deleted, next_later(time).clamp(max=T - 1), slots)
    f = torch.where(deleted, pair_fraction(average, average.gather(2, parent)), 0.0)
    # Children of one parent, contiguous and in deletion order; survivors sort last, one segment each.
    segment = torch.where(deleted, parent, T + slots)
    by_parent = torch.sort(segment * (T + 1) + torch.where(deleted, time, 0), dim=-1).indices
    seg, keep = segment.gather(2, by_parent), (1 - f).gather(2, by_parent)
    suffix = segment_suffix_product(keep, seg)  # product from each child to its parent's last merge
    same_next = F.pad(seg[..., 1:] == seg[..., :-1], (0, 1))
    after = torch.where(same_next, F.pad(suffix[..., 1:], (0, 1), value=1.0), 1.0)  # strictly later siblings
    first = ~F.pad(seg[..., 1:] == seg[..., :-1], (1, 0))
    edge = torch.ones_like(f).scatter_(2, by_parent, after) * f + (~deleted).float()  # survivors: edge 1
    own = torch.ones_like(f).scatter_reduce_(2, seg.clamp(max=T - 1), torch.where(first & (seg < T), suffix, 1.0),
                                             "prod")  # each parent: the product over all of its children
    root, path = parent.clone(), edge
    for _ in range(max(1, (T - 1).bit_length())):  # pointer doubling: 2^k >= T hops reach the root
        path = path * path.gather(2, root)
        root = root.gather(2, root)
    coefficient = own * path
    merged = torch.zeros(B, H, T, D, dtype=torch.float32, device=device)
    merged.scatter_add_(2, root.unsqueeze(-1).expand(-1, -1, -1, D), values.float() * coefficient.unsqueeze(-1))
    return merged.to(values.dtype), ~deleted


def next_later(time: Tensor) -> Tensor:
    """(B, H, T) long -> for each slot j the first k > j with time[k] > time[j] (T if none): a sparse table of
    range maxima over powers of two, then binary lifting that skips every block whose maximum is <= time[j]
    (``kernels.triton_next_later`` is the one-launch twin, see ``dispatch``)."""
    if use_triton("next_later", time):
        from kvbench.kernels import triton_next_later

        return triton_next_later.next_later(time)
    T = time.shape[-1]
    tables = [time]  # tables[l][i] = max time[i : i + 2^l] (clipped at T)
    while 2 ** len(tables) <= T:
        span, previous = 2 ** (len(tables) - 1), tables[-1]
        tables.append(torch.cat([torch.maximum(previous[..., :-span], previous[..., span:]),
                                 previous[..., -span:]], dim=-1))
    position = torch.arange(1, T + 1, device=time.device).expand_as(time).contiguous()
    for level in reversed(range(len(tables))):
        size = 2 ** level
        block_max = tables[level].gather(2, position.clamp(max=T - 1))
        skip = (position + size <= T) & (block_max <= time)
        position = torch.where(skip, position + size, position)
    return position


def segment_suffix_product(x: Tensor, segment: Tensor) -> Tensor:
    """Inclusive product of ``x`` from each entry to the end of its run of equal ``segment`` ids (last axis,
    runs contiguous): Hillis-Steele doubling, log T passes; exact with zero factors (no division)."""
    out, step, T = x.clone(), 1, x.shape[-1]
    while step < T:
        same = segment[..., step:] == segment[..., :-step]
        out = torch.cat([torch.where(same, out[..., :-step] * out[..., step:], out[..., :-step]),
                         out[..., -step:]], dim=-1)
        step *= 2
    return out
