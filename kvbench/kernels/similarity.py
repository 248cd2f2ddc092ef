"""Key-similarity operations on left-aligned ragged rows: adjacent cosines, runs of similar neighbours, and
each source slot's most similar target slot.

Used by KVMerger (merging sets = runs of consecutive similar keys) and D2O (nearest kept slot of every
evicted slot: only the |E| x |C| block, in chunks). No (T x T) similarity matrix is ever
built: the chain rule needs the T-1 adjacent cosines, the anchor rule one cosine per slot. Torch references
in float32; ``triton_similarity`` holds kernels of the same signatures for ``adjacent_cosine``,
``anchor_runs`` and ``best_match_cosine`` (see ``dispatch``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvbench.kernels.dispatch import use_triton
from kvbench.kernels.select import true_first


def unit_keys(keys: Tensor) -> Tensor:
    """(B, H, T, D) -> float32 unit vectors; zero (padding) keys stay zero, so their cosines are 0."""
    return F.normalize(keys.float(), dim=-1, eps=1e-12)


def adjacent_cosine(keys: Tensor) -> Tensor:
    """cos(k_t, k_{t+1}) for every adjacent slot pair: keys (B, H, T, D) -> (B, H, T-1) float32."""
    if use_triton("adjacent_cosine", keys):
        from kvbench.kernels import triton_similarity

        return triton_similarity.adjacent_cosine(keys)
    unit = unit_keys(keys)
    return (unit[:, :, :-1] * unit[:, :, 1:]).sum(-1)


def run_ids(joins_next: Tensor, lengths: Tensor) -> Tensor:
    """Number the runs of each row left to right.

    joins_next: (B, H, T-1) bool, True where slot t belongs to the same run as slot t+1.
    lengths:    (B, H) real slots per row.
    Returns (B, H, T) long: run id of every real slot (0, 1, ... in positional order), -1 on padding.
    """
    B, H, n_pairs = joins_next.shape
    starts = torch.ones(B, H, n_pairs + 1, dtype=torch.long, device=joins_next.device)
    starts[..., 1:] = (~joins_next).long()
    ids = starts.cumsum(-1) - 1
    slots = torch.arange(n_pairs + 1, device=joins_next.device).view(1, 1, -1)
    return torch.where(slots < lengths.unsqueeze(-1), ids, torch.full_like(ids, -1))


def chain_runs(similarity: Tensor, mergeable: Tensor, lengths: Tensor, epsilon: float) -> Tensor:
    """Runs under the chain rule (KVMerger Algorithm 1 read literally): slots t and t+1 share a run iff both
    are mergeable and cos(k_t, k_{t+1}) > epsilon. A slot that is not mergeable is a run of its own.

    similarity: (B, H, T-1) adjacent cosines; mergeable: (B, H, T) bool; lengths: (B, H).
    Returns run ids (B, H, T) as ``run_ids``. Cost O(T).
    """
    joins = (similarity > epsilon) & mergeable[..., :-1] & mergeable[..., 1:]
    return run_ids(joins, lengths)


def anchor_runs(keys: Tensor, mergeable: Tensor, lengths: Tensor, epsilon: float) -> Tensor:
    """Runs under the anchor rule: scanning from the last slot to the first, a run starts at its right-most
    slot (the anchor) and grows left while the next slot is mergeable and cos(k_anchor, k_j) > epsilon.

    keys: (B, H, T, D); mergeable: (B, H, T) bool; lengths: (B, H).
    Returns run ids (B, H, T) as ``run_ids``. Cost O(T D), but a sequential scan of T steps over all rows.
    """
    if use_triton("anchor_runs", keys):
        from kvbench.kernels import triton_similarity

        return triton_similarity.anchor_runs(keys, mergeable, lengths, epsilon)
    unit = unit_keys(keys)
    B, H, T, D = unit.shape
    joins = torch.zeros(B, H, max(T - 1, 0), dtype=torch.bool, device=keys.device)
    if T < 2:
        return run_ids(joins, lengths)
    anchor = unit[:, :, T - 1]  # (B, H, D) unit key of the anchor of the run that holds slot t+1
    for t in range(T - 2, -1, -1):
        join = mergeable[:, :, t] & mergeable[:, :, t + 1] & ((anchor * unit[:, :, t]).sum(-1) > epsilon)
        joins[:, :, t] = join
        anchor = torch.where(join.unsqueeze(-1), anchor, unit[:, :, t])
    return run_ids(joins, lengths)


def _compact(mask: Tensor) -> tuple[Tensor, Tensor]:
    """(B, H, T) bool -> (index (B, H, N) of the True slots in order, count (B, H)); N = max count."""
    count = mask.sum(-1)
    n = int(count.max()) if count.numel() else 0
    return true_first(mask)[..., :n], count


def best_match_cosine(keys: Tensor, sources: Tensor, targets: Tensor, chunk: int = 512) -> tuple[Tensor, Tensor]:
    """For every source slot, the target slot of the same row whose key has the highest cosine similarity.

    keys: (B, H, T, D); sources, targets: (B, H, T) bool (e.g. evicted and kept slots).
    Only the |sources| x |targets| block is computed, ``chunk`` source slots at a time: memory
    O(B H chunk |targets|), time O(B H |sources| |targets| D). 512 rather than 1,024: D2O's prefill search on the
    CPU at a 4k SmolLM2 prompt (3,277 sources x 819 targets a head) took 16-20 ms against 27-31 (the block stays
    nearer the cores' caches); the same float32 products at any chunk.

    Returns (similarity, match), both (B, H, T): float32 cos(k_s, k_match(s)) on source slots, -inf elsewhere
    (also for sources of a row without targets); match = the target's slot index, -1 where similarity is
    -inf. Ties go to the earliest target slot.
    """
    if use_triton("best_match_cosine", keys):
        from kvbench.kernels import triton_similarity

        return triton_similarity.best_match_cosine(keys, sources, targets, chunk)
    if keys.shape[0] > 1:
        # row by row: each row's products at its own source and target counts, the shapes it has alone (the BLAS
        # picks its blocking by shape, and a row padded to another row's counts can differ in the last bit)
        rows = [best_match_cosine(keys[b:b + 1], sources[b:b + 1], targets[b:b + 1], chunk)
                for b in range(keys.shape[0])]
        return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
    B, H, T, D = keys.shape
    src, src_count = _compact(sources)
    tgt, tgt_count = _compact(targets)
    similarity = torch.full((B, H, T + 1), -float("inf"), device=keys.device)  # slot T: dump for padding
    match = torch.full((B, H, T + 1), -1, dtype=torch.long, device=keys.device)
    if src.shape[-1] == 0 or tgt.shape[-1] == 0:
        return similarity[..., :T], match[..., :T]
    tgt_keys = unit_keys(keys.gather(2, tgt.unsqueeze(-1).expand(-1, -1, -1, D)))  # (B, H, C, D)
    tgt_padding = torch.arange(tgt.shape[-1], device=keys.device).view(1, 1, 1, -1) >= tgt_count.view(B, H, 1, 1)
    ragged = bool(tgt_padding.any())  # heads with fewer targets than the widest: their padding is masked
    for start in range(0, src.shape[-1], chunk):
        rows = src[..., start:start + chunk]  # (B, H, e) slot indices
        src_keys = unit_keys(keys.gather(2, rows.unsqueeze(-1).expand(-1, -1, -1, D)))
        sim = src_keys @ tgt_keys.transpose(-1, -2)  # (B, H, e, C)
        if ragged:
            sim.masked_fill_(tgt_padding, -float("inf"))
        best, arg = sim.max(-1)
        rank = torch.arange(start, start + rows.shape[-1], device=keys.device).view(1, 1, -1)
        real = (rank < src_count.unsqueeze(-1)) & torch.isfinite(best)
        write_at = torch.where(real, rows, torch.full_like(rows, T))
        similarity.scatter_(2, write_at, torch.where(real, best, -float("inf")))
        match.scatter_(2, write_at, torch.where(real, tgt.gather(2, arg), -1))
    return similarity[..., :T], match[..., :T]


def slot_best_match(keys: Tensor, positions: Tensor, slot: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """``best_match_cosine`` for one source slot per row (B, H), in any slot order (a decode step in place).

    keys: (B, H, T, D); positions: (B, H, T); targets: (B, H, T) bool. Returns (similarity, match), both (B, H):
    float32 cos(k_slot, k_match), -inf without targets; the target's slot, -1 without targets. Ties go to the
    oldest position (the earliest target of a position-ordered row, as ``best_match_cosine``). Fixed shapes:
    one (1 x T) similarity row, no host read."""
    unit = unit_keys(keys)
    source = unit.gather(2, slot.view(*slot.shape, 1, 1).expand(-1, -1, 1, unit.shape[-1]))  # (B, H, 1, D)
    cosine = (source @ unit.transpose(-1, -2)).squeeze(-2).masked_fill(~targets, -float("inf"))  # (B, H, T)
    best = cosine.amax(-1)
    tied = targets & (cosine == best.unsqueeze(-1))
    match = torch.where(tied, positions, torch.iinfo(positions.dtype).max).argmin(-1)
    return best, torch.where(torch.isfinite(best), match, -1)
