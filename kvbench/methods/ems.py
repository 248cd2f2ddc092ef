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
becomes the TBM token, merged into its most redundant other centre or evicted. ``compress`` runs the same
partition on the row's N_budget + 1 slots (prefill and decode share one code path); the engine's decode step
does it in place (``evict_one``, ``kernels.ems_step``: the same cache up to slot and table order).

Shared entry expansion (``expansion``). What the paper specifies [P §4.2, App. A, §5.4]: N_budget stored
entries per head plus, per token, its key norm ||k_j|| and a position look-up table (LUT) mapping each
merged token to its class centre; "during the computation of each layer, a smaller cache is loaded and
expanded with the help of this table" to about gamma * N_budget tokens: member j of centre c gets the key
||k_j|| * k_hat_c, RoPE'd after expansion (merging is done on raw keys), and the value v_c; the zero class is
eviction. With both variants k_hat_c = normalise(sum_j w_j k_j_raw / ||k_j_raw||) (renormalised: the paper
does not say; so members keep their norms exactly).
- ``lut`` (default), the paper's way. A merged entry's stored key is its centre's own expanded key
  ||k_c|| * RoPE_{p_c}(k_hat_c) (RoPE at the centre's position read off its own raw/rotated key pair,
  ``rotate_like``); the LUT (``LayerKV.tables``) holds, per member that is not its entry's own token,
  its position p_j, its centre's position p_c and its norm ||k_j||. ``expand`` (asked by the engine's
  attention for every pass over a compressed layer, ``Method.expand``) appends every member as
  ||k_j|| * unit(RoPE_{p_j - p_c}(key_c)) ("w. pos" [I]: at its own position; under
  ``engine.position_mode=cache_length`` at its offset from the centre's RoPE position) or ||k_j|| * unit(key_c)
  ("w.o. pos" [I]: at the centre's), with v_c; so a cluster takes sum_j exp(l_j) of the softmax. Zero-class
  tokens are never in the table (masked: not a zero key, which would take softmax mass). The statistics of a
  pass (s_Glo, s_Loc) reach a stored entry summed over its expanded members (the cluster's attention mass).
  The LUT has a fixed size per head, (gamma - 1) * N_budget entries (the TBM tokens of a full prefill;
  gamma = inf: the prefill's TBM count), all counted in the cache's bytes (20 bytes an entry: two int64
  positions and a float32 norm) besides the N_budget K/V slots.
  What the paper leaves open (§2.g.4): at decode, "we need to evict one element from the look-up-table and
  fill the new mapping", without saying which. Reading [I]: a decode step's TBM centre either joins its
  destination's cluster (it and its members re-point to the destination, the centre itself becomes one new
  LUT element) or goes to the zero class with its members (their elements are freed); when the table is full,
  the element evicted is a free (zero-class) one if any, else the member with the oldest position (the LUT
  keeps its newest members). The same rule applies to any compression (prefill chunks, multi-token passes).
  Expansion has static shapes (stored capacity + LUT size, masked, no host read), and a decode step evicts in
  place with the LUT rewritten in place (``evict_one``, ``kernels.ems_step``), so decode steps replay as CUDA
  graphs. "w.o. pos" needs no view at a decode step: a member's logit is its centre's times
  rho_j = ||k_j|| / ||k_c||, so one query attends to the stored slots with slot c weighing
  exp(l_c) + sum_j exp(rho_j l_c) (``kernels.lut_attention``, reading K and V once; the expansion's
  ``CentreMembers``); passes of several queries, and "w. pos", read the view (``kernels.lut_expand``). The
  members' centre slots are found by position at every pass (``kernels.lut_expand.centre_slots``: through a map
  from position to slot where the pass knows a bound on the positions, as every decode step does, else a sort of
  the stored positions; a decode step's attention kernel writes and reads that map in its own launches).
- ``bias`` [I], the earlier stand-in: each entry stores the score-weighted MEAN of its members' expanded keys,
    key_c = sum_j w_j * ||k_j|| * RoPE_{p_j}(k_hat_c),
  with p_j = pos_j (positions="with") or p_j = pos_c (positions="without": key_c = mean norm * RoPE_{p_c}(k_hat_c)),
  so the entry's attention logit is exactly the weighted mean of the logits the expanded members would get.
  With ``multiplicity_bias=true`` the entry keeps the per-slot ``state["logit_bias"] = log m``, m = the plain
  count of original tokens it stands for, carried through decode merges (counts add; zero-class members are
  gone), so its softmax weight is m * exp(mean logit): the expanded cluster's only when its members' logits
  coincide; it is not sum_j exp(l_j) otherwise (on SmolLM2 activations the attention output differs by a
  median 0.08%, p90 0.77%, max 22%). ``multiplicity_bias=false``: one share per cluster.

Per-slot state (LayerKV.state, moves with the slot):
  s_glo                 accumulated attention from every query (prompt, then each decode step)
  s_loc_past, s_loc_cur local accumulators: past = last full window of L_win decode queries, cur = the
                        ones since; s_Loc = past + cur (prefill: past = the prompt's last L_win queries)
  s_loc_cur_queries     queries summed into s_loc_cur (the same on every slot of a row)
  merged_mass           merge weight of the members absorbed into this entry; an entry's merge weight is
                        its current score + merged_mass, so clusters merged again at decode keep their mass
  merged_tokens         original tokens merged into this entry besides its own (m - 1; new tokens start at 0);
                        with ``lut`` it counts merges, some of which the full LUT may have evicted since
  logit_bias            log m, only with expansion=bias and multiplicity_bias (see above); read by attention
Key norms need no state: a stored key's norm is its centre's own (lut) or its members' weighted mean (bias),
and RoPE keeps norms; the LUT keeps the members' norms.

Readings [I], see §2.g: merge weights are the pooled Global-Local score at prefill and score + merged_mass
at decode; a merged entry keeps its centre's own s_Glo/s_Loc (it is ranked as the centre); pooling is applied
at prefill only (at decode stored slots are no longer neighbours in the text); GQA: budgets and merges are per
KV head with attention averaged over the group (the engine's statistics); cosines in R are clamped at 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kvbench.errors import ConfigError
from kvbench.kernels.ems_step import ems_observe, ems_step, global_local_score, tbm_share
from kvbench.kernels.lut_expand import centre_slots, expand_lut
from kvbench.kernels.merge import group_sum, scatter_merge
from kvbench.kernels.redundancy import SIMILARITIES, most_redundant, rotate_like
from kvbench.kernels.select import pool1d, true_first
from kvbench.kernels.similarity import unit_keys
from kvbench.kv import LOGIT_BIAS, AttentionStats, CentreMembers, Expansion, HostSizes, LayerKV
from kvbench.methods.base import Method, check_unit_interval, per_sample_n_keep

POSITIONS = ("with", "without")
EXPANSIONS = ("lut", "bias")
STATE = ("s_glo", "s_loc_past", "s_loc_cur", "s_loc_cur_queries", "merged_mass", "merged_tokens")
# The look-up table (LayerKV.tables), one entry per merged member that is not its entry's own token:
LUT_POSITION = "lut_position"  # the member's original position (-1: unused)
LUT_CENTRE = "lut_centre"  # original position of the stored slot (class centre) it is expanded from
LUT_NORM = "lut_norm"  # the member's key norm ||k_j||


@dataclass
class EMS(Method):
    """window: L_win; kernel_size: mean pooling of the score; tau: merge threshold on R; gamma: merge
    magnification (N_budget + N_tbm) / N_budget (1 = eviction only, inf = no first-level eviction);
    similarity: key_value | key | value; positions: with | without (EMS w. pos / w.o. pos);
    expansion: lut (the paper's look-up-table expansion at attention time) | bias (mean key + log m bias) [I];
    multiplicity_bias: with expansion=bias, add log(member count) to a merged entry's attention logit [I]."""

    name: ClassVar[str] = "ems"
    keeps_exact_budget: ClassVar[bool] = True
    needs: ClassVar[frozenset[str]] = frozenset({"column_sums", "window_column_sums", "raw_keys"})
    decode_needs: ClassVar[frozenset[str]] = frozenset({"step_attention", "raw_keys"})
    phases: ClassVar[frozenset[str]] = frozenset({"prefill", "decode"})
    evicts_in_place: ClassVar[bool] = True
    unrotates_in_place: ClassVar[bool] = True

    window: int = 32
    kernel_size: int = 7
    tau: float = 0.6
    gamma: float = 4
    similarity: str = "key_value"
    positions: str = "without"
    multiplicity_bias: bool = True
    expansion: str = "lut"
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
        if self.expansion == "lut" and not self.multiplicity_bias:
            raise ConfigError("ems: multiplicity_bias=false only exists with expansion=bias (the LUT expands every "
                              "member); accepted with expansion=lut: multiplicity_bias=true")

    # -- engine hooks ---------------------------------------------------------------------------------

    @property
    def expands_slots(self) -> bool:
        return self.expansion == "lut"

    def expand(self, layer: int, kv: LayerKV, rotate: Callable[[Tensor, Tensor], Tensor],
               position_limit: int | None = None) -> Expansion | None:
        """Stored slots, then every LUT member as ||k_j|| * unit(key_c) ("w.o. pos": at the centre's RoPE
        position) or ||k_j|| * unit(RoPE_{p_j - p_c}(key_c)) ("w. pos": at its own), with its centre's value;
        unused entries masked. Left-aligned over the static capacity T + E, built only when a pass reads it:
        "w.o. pos" also gives the members as such (``CentreMembers``), which a one-query pass attends from
        the stored slots. The members' centre slots are found by position (``centre_slots``, through a map of
        ``position_limit`` entries where the pass knows that bound)."""
        if LUT_POSITION not in kv.tables or kv.tables[LUT_POSITION].shape[-1] == 0:
            return None
        position, centre, norm = kv.tables[LUT_POSITION], kv.tables[LUT_CENTRE], kv.tables[LUT_NORM]

        def view() -> tuple[LayerKV, Tensor]:
            slot, live = centre_slots(kv.positions, kv.lengths, centre, position_limit)
            member_keys = None  # "w.o. pos": the kernel reads each member's centre key itself
            if self.positions == "with":
                centre_keys = kv.keys.gather(2, slot.unsqueeze(-1).expand(-1, -1, -1, kv.keys.shape[-1]))
                member_keys = rotate(centre_keys, torch.where(live, position - centre, 0))
            keys, values, positions, slots, lengths = expand_lut(kv.keys, kv.values, kv.positions, kv.lengths, slot,
                                                                 live, position, norm, member_keys)
            return LayerKV(keys=keys, values=values, positions=positions, lengths=lengths), slots

        return Expansion(view, CentreMembers(centre, norm, position_limit) if self.positions == "without" else None)

    def compress(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor, phase: str,
                 host: HostSizes | None = None) -> LayerKV:
        valid = kv.valid()
        if phase == "prefill":
            kv = replace(kv, state=self._prefill_state(kv, stats))
            score = self._pooled(global_local_score(kv.state["s_glo"], kv.state["s_loc_past"], valid), valid)
        else:
            s_loc = kv.state["s_loc_past"] + kv.state["s_loc_cur"]
            score = global_local_score(kv.state["s_glo"], s_loc, valid)
        raw_keys = stats.raw_keys
        budget = int(n_keep.max()) if host is None else int(host.n_keep.max())
        return self._evict_then_merge(kv, raw_keys, score, per_sample_n_keep(n_keep, kv), budget, host)

    def observe(self, layer: int, kv: LayerKV, stats: AttentionStats) -> None:
        """Accumulate the newest query's attention into s_Glo and s_Loc^cur; roll the local window every
        L_win queries (s_Loc^past <- s_Loc^cur, s_Loc^cur <- 0). In place (``kernels.ems_step.ems_observe``):
        a captured decode step keeps the state tensors."""
        state = kv.state
        ems_observe(state["s_glo"], state["s_loc_past"], state["s_loc_cur"], state["s_loc_cur_queries"],
                    stats.step(), kv.lengths, self.window)

    def evict_one(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor) -> None:
        """``compress`` of a row one slot over its budget, in place, the look-up table included
        (``kernels.ems_step``): the lowest-scoring centre merges into its most redundant other centre, or
        leaves for the zero class. The raw keys: ``stats.raw_keys``, or the kernel's own from ``stats.rope``
        (``unrotates_in_place``)."""
        state = kv.state
        lut = (kv.tables[LUT_POSITION], kv.tables[LUT_CENTRE], kv.tables[LUT_NORM]) if self.expansion == "lut" \
            else None
        ems_step(kv.keys, kv.values, kv.positions, kv.lengths, kv.state_storage(), stats.raw_keys,
                 (state["s_glo"], state["s_loc_past"], state["s_loc_cur"]),
                 (state["merged_mass"], state["merged_tokens"], state.get(LOGIT_BIAS)), lut, n_keep, self.window,
                 self.tau, self.gamma, self.similarity, self.positions == "with", stats.rope)

    # -- the algorithm --------------------------------------------------------------------------------

    def _prefill_state(self, kv: LayerKV, stats: AttentionStats) -> dict[str, Tensor]:
        """Fresh per-slot state from the prompt pass: s_Glo = column sums, s_Loc^past = window column sums."""
        s_glo = stats.column_sums.float()
        state = {name: torch.zeros_like(s_glo) for name in STATE}
        state["s_glo"] = s_glo
        state["s_loc_past"] = stats.window_column_sums.float()
        return state

    def _pooled(self, score: Tensor, valid: Tensor) -> Tensor:
        """(B, H, T) mean pooling over each slot's real neighbours (ragged rows end in padding, not zeros)."""
        neighbours = pool1d(valid.float(), self.kernel_size, "mean").clamp(min=1e-30)
        return pool1d(score, self.kernel_size, "mean") / neighbours * valid

    def _partition(self, score: Tensor, valid: Tensor, lengths: Tensor, n_keep: Tensor,
                   host: HostSizes | None = None) -> tuple[Tensor, ...]:
        """(B, H, T) score -> masks local, imp (B, H, T); tbm_slots (B, H, M) and its validity (B, H, M).

        Slots outside the local window are ranked by score: Imp = the top N_budget - L_win, TBM = the next
        (gamma - 1) * N_budget, Irr = the rest. TBM slots come out in rank order. ``host``: the sizes, to know
        M without reading it back.
        """
        T = score.shape[-1]
        slots = torch.arange(T, device=score.device).view(1, 1, -1)
        n_loc = n_keep.clamp(max=self.window)
        local = valid & (slots >= (lengths - n_loc).unsqueeze(-1))
        candidate = valid & ~local
        n_imp = n_keep - n_loc
        n_tbm = torch.minimum(tbm_share(n_keep, self.gamma), (candidate.sum(-1) - n_imp).clamp(min=0))
        order = torch.where(candidate, score, -torch.inf).argsort(dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(-1, order, slots.expand_as(order).contiguous())
        imp = candidate & (rank < n_imp.unsqueeze(-1))
        if host is not None:
            M = self._most_tbm(host)
        else:
            M = int(n_tbm.max()) if n_tbm.numel() else 0
        offset = torch.arange(M, device=score.device).view(1, 1, -1)
        tbm_valid = offset < n_tbm.unsqueeze(-1)
        tbm_slots = order.gather(-1, (n_imp.unsqueeze(-1) + offset).clamp(max=T - 1))
        return local, imp, tbm_slots, tbm_valid

    def _most_tbm(self, host: HostSizes) -> int:
        """M of ``_partition`` from the host's sizes: the window and Imp take ``min(N_budget, length)`` slots of a
        row, so TBM takes at most the rest of it."""
        keep = host.kept()
        n_tbm = tbm_share(torch.from_numpy(keep), self.gamma).numpy()
        return int(np.minimum(n_tbm, host.lengths - keep).max(initial=0))

    def _destinations(self, kv: LayerKV, raw_keys: Tensor, imp: Tensor, tbm_slots: Tensor,
                      tbm_valid: Tensor) -> Tensor:
        """Most redundant centre of each TBM slot (Eq. 5): (B, H, M) slot index, or -1 (zero class: R < tau)."""
        best, match = most_redundant(raw_keys, kv.values, tbm_slots, tbm_valid.sum(-1), true_first(imp), imp.sum(-1),
                                     self.similarity)
        return torch.where(best >= self.tau, match, -1)

    def _evict_then_merge(self, kv: LayerKV, raw_keys: Tensor, score: Tensor, n_keep: Tensor, budget: int,
                          host: HostSizes | None = None) -> LayerKV:
        """Keep Loc + Imp (original order), merge redundant TBM slots into their centres, evict the rest.
        ``budget``: the largest N_budget of the batch (before clamping to short rows), which sizes the LUT;
        ``host``: the call's sizes, where the host knows them (then nothing is read back)."""
        valid = kv.valid()
        local, imp, tbm_slots, tbm_valid = self._partition(score, valid, kv.lengths, n_keep, host)
        kept = local | imp
        lengths = kept.sum(-1)
        if host is not None:  # kept: min(N_budget, length) slots a row
            G = max(int(host.kept().max(initial=0)), 1)
        else:
            G = max(int(lengths.max()) if lengths.numel() else 0, 1)
        index = true_first(kept)[..., :G]  # kept slots in original order
        group = kept.long().cumsum(-1) - 1  # entry of each kept slot
        dest = self._destinations(kv, raw_keys, imp, tbm_slots, tbm_valid)
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
        merged = (members > 1).unsqueeze(-1)
        # a plain gather where nothing merged: no TBM slot (gamma = 1, known on the host), or every TBM slot went to
        # the zero class (read back only without ``host``; with it the merge below keeps every entry as it is)
        gather_only = tbm_slots.shape[-1] == 0 or (host is None and not bool(merged.any()))
        # (B, H, T), taken once for the LUT and the merged keys, and only where one of them reads it (RoPE keeps norms)
        norms = kv.keys.float().norm(dim=-1) if self.expansion == "lut" or not gather_only else None
        if self.expansion == "lut":
            size = self._lut_size(tbm_slots.shape[-1], budget)
            lut = kv.tables.get(LUT_POSITION)
            out.tables = self._lut(kv, norms, target, index, out.positions,
                                   max(size, 0 if lut is None else lut.shape[-1]))
        elif self.multiplicity_bias:
            out.state[LOGIT_BIAS] = torch.where(out.valid(), tokens.clamp(min=1).log(), 0.0)
        if gather_only:
            return out
        out.keys = torch.where(merged, self._merged_keys(kv, norms, raw_keys, target, w, index), out.keys)
        out.values = torch.where(merged, scatter_merge(kv.values, target, w, G), out.values)
        return out

    def _merged_keys(self, kv: LayerKV, norms: Tensor, raw_keys: Tensor, target: Tensor, w: Tensor,
                     index: Tensor) -> Tensor:
        """(B, H, G, D): per entry, the w-weighted mean of its members' expanded keys (see module doc); ``norms``
        (B, H, T): the stored keys' norms."""
        G = index.shape[-1]
        norms = norms.unsqueeze(-1)  # (B, H, T, 1)
        shared = unit_keys(scatter_merge(unit_keys(raw_keys), target, w, G))  # k_hat_c, renormalised
        if self.positions == "without" or self.expansion == "lut":
            d_index = index.unsqueeze(-1).expand(-1, -1, -1, kv.keys.shape[-1])
            at_centre = rotate_like(shared, raw_keys.gather(2, d_index), kv.keys.gather(2, d_index))
            if self.expansion == "lut":  # the centre's own expanded key; its members are expanded at attention
                return (at_centre * norms.gather(2, index.unsqueeze(-1))).to(kv.keys.dtype)
            return (at_centre * scatter_merge(norms, target, w, G)).to(kv.keys.dtype)
        d_target = target.clamp(min=0).unsqueeze(-1).expand(-1, -1, -1, kv.keys.shape[-1])
        expanded = rotate_like(shared.gather(2, d_target), raw_keys, kv.keys) * norms  # (B, H, T, D)
        return scatter_merge(expanded, target, w, G).to(kv.keys.dtype)

    # -- the look-up table -----------------------------------------------------------------------------

    def _lut_size(self, most_tbm: int, budget: int) -> int:
        """Entries per head of the LUT a prefill makes: the TBM tokens of a full prefill at the largest N_budget
        ``budget``, (gamma - 1) * N_budget, or with gamma = inf the most TBM tokens of a head, ``most_tbm``."""
        return most_tbm if math.isinf(self.gamma) else math.floor((self.gamma - 1) * budget + 0.5)

    def batch_row(self, out: LayerKV, b: int, capacity: int, host: HostSizes) -> LayerKV:
        """The row's LUT cut to the size a prefill of the row alone gives it. The table holds the newest members
        first (``_lut``: a top-k by position), unused entries last, so its first entries are the row's own."""
        row = out.row(b, capacity)
        if LUT_POSITION in row.tables:
            most_tbm = int((host.lengths[b] - host.kept()[b]).max())
            size = self._lut_size(most_tbm, int(host.n_keep[b]))
            row.tables = {name: t[..., :size].contiguous() for name, t in row.tables.items()}
        return row

    def _lut(self, kv: LayerKV, norms: Tensor, target: Tensor, index: Tensor, centres: Tensor,
             size: int) -> dict[str, Tensor]:
        """The LUT after a compression, ``size`` entries per head: members already in it follow their centre's
        slot to the entry that slot went to, or leave with it (zero class, first-level eviction); slots merged
        into another slot's entry join; the ``size`` newest members stay (see the module doc) [I].
        ``target`` (B, H, T): entry of every input slot or -1; ``index`` (B, H, G): the slot each entry keeps;
        ``centres`` (B, H, G): the entries' positions; ``norms`` (B, H, T): the input slots' key norms."""
        slots = torch.arange(target.shape[-1], device=target.device)
        joins = (target >= 0) & (index.gather(-1, target.clamp(min=0)) != slots)
        groups, positions, norms = [torch.where(joins, target, -1)], [kv.positions], [norms]
        if LUT_POSITION in kv.tables:
            slot, live = centre_slots(kv.positions, kv.lengths, kv.tables[LUT_CENTRE])
            groups.append(torch.where(live, target.gather(-1, slot), -1))
            positions.append(kv.tables[LUT_POSITION])
            norms.append(kv.tables[LUT_NORM])
        group, position, norm = (F.pad(torch.cat(x, -1), (0, max(0, size - sum(t.shape[-1] for t in x))), value=-1)
                                 for x in (groups, positions, norms))
        keep = torch.where(group >= 0, position, -1).topk(size, dim=-1).indices
        group = group.gather(-1, keep)
        live = group >= 0
        return {LUT_POSITION: torch.where(live, position.gather(-1, keep), -1),
                LUT_CENTRE: torch.where(live, centres.gather(-1, group.clamp(min=0)), -1),
                LUT_NORM: torch.where(live, norm.gather(-1, keep), -1.0)}
