"""Score-based slot selection shared by every eviction method: protected sinks + recent window + top-k, and
a plain top-count-per-row mask.

The protection rules of StreamingLLM (``sinks_and_recent``, ``eviction_order``) and H2O (``heavy_split``) live here
because CaM's decode step (``cam_step``) evicts with either.

All functions work on left-aligned ragged rows (see ``kvbench.kv.LayerKV``): row ``(b, h)`` has
``lengths[b, h]`` real slots; slots ``[0, sinks)`` are the oldest tokens and ``[len - recent, len)`` the newest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def true_first(mask: Tensor) -> Tensor:
    """(..., T) bool -> (..., T) slot indices: the True slots first, then the others, each in slot order."""
    return (~mask).to(torch.int8).argsort(dim=-1, stable=True)


def protected_mask(lengths: Tensor, capacity: int, sinks: int, recent: int) -> Tensor:
    """(B, H, T) bool: the first ``sinks`` and last ``recent`` real slots of each row."""
    slots = torch.arange(capacity, device=lengths.device).view(1, 1, -1)
    length = lengths.unsqueeze(-1)
    return (slots < min(sinks, capacity)) | ((slots >= length - recent) & (slots < length))


def sinks_and_recent(n_keep: Tensor, sinks: int) -> tuple[Tensor, Tensor]:
    """(B, H) budget -> per-row (sinks, recent), each (B, H, 1), with sinks + recent = n_keep (StreamingLLM).

    ``keep_topk`` broadcasts them against (B, H, T) slot indices, so every row gets its own window.
    """
    row_sinks = n_keep.clamp(max=sinks)
    return row_sinks.unsqueeze(-1), (n_keep - row_sinks).unsqueeze(-1)


def eviction_order(positions: Tensor, keep: Tensor, sinks: int) -> tuple[Tensor, Tensor, Tensor]:
    """(scores, sinks, recent) for ``slots.select_lowest``: the one slot a row of ``keep`` (B, H) + 1 slots
    drops under StreamingLLM is the oldest after the sinks, or the newest when the budget is all sinks."""
    row_sinks, recent = sinks_and_recent(keep, sinks)
    age = torch.where(recent > 0, positions, -positions)  # oldest first; newest first if no window
    return age, row_sinks.squeeze(-1), torch.zeros_like(keep)


def heavy_split(keep: Tensor, heavy_ratio: float, sinks: int) -> tuple[Tensor, Tensor]:
    """Per-row (B, H, 1) protected sinks and recent window of a (B, H) budget split into
    ``floor(heavy_ratio * keep)`` heavy hitters (sinks among them) and the rest recent (H2O, CaM's H2O)."""
    heavy = torch.floor(heavy_ratio * keep.double()).long()
    return heavy.clamp(max=sinks).unsqueeze(-1), (keep - heavy).unsqueeze(-1)


def keep_topk(
    scores: Tensor, n_keep: Tensor, lengths: Tensor, sinks: int | Tensor = 0, recent: int | Tensor = 0,
    row_sizes: list[int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Pick which slots each row keeps.

    scores:  (B, H, T) higher = more important; padding slots are ignored.
    n_keep:  (B, H) slots to keep per row (rows shorter than that keep everything).
    sinks, recent: protected slot counts, one int for every row or a (B, H, 1) long tensor of per-row counts.
    Protected slots (sinks, recent) are kept first; the rest of the budget goes to the highest scores.
    If the protected slots alone exceed ``n_keep`` the most recent of them win, then the sinks.
    row_sizes: per batch row, ``max(min(n_keep, lengths))`` over its heads where the host knows it
    (``HostSizes.most_kept``); None reads it back from the device.

    Returns (index, new_lengths): index (B, H, K) of kept slots in original order, padded with the
    row's last kept slot past ``new_lengths``; K = max(new_lengths).
    """
    B, H, T = scores.shape
    n_keep = torch.minimum(n_keep.to(lengths), lengths)
    slots = torch.arange(T, device=scores.device).view(1, 1, -1)
    valid = slots < lengths.unsqueeze(-1)
    recent_mask = (slots >= lengths.unsqueeze(-1) - recent) & valid
    sink_mask = (slots < sinks) & valid & ~recent_mask
    # Priority tiers: recent window > sinks > scored tokens; ties inside the score tier by score.
    big = torch.finfo(torch.float32).max / 4
    prio = scores.float().clamp(min=-big / 2, max=big / 2)
    prio = torch.where(sink_mask, big, prio)
    prio = torch.where(recent_mask, slots.float() + 2 * big, prio)
    prio = torch.where(valid, prio, -float("inf"))
    if row_sizes is not None:
        row_k = row_sizes
    else:
        row_k = n_keep.amax(-1).tolist() if n_keep.numel() else []  # the one read back from the device
    k = max(row_k, default=0)
    top = prio.topk(k, dim=-1).indices if k > 0 else prio.new_zeros((B, H, 0), dtype=torch.long)
    for b, size in enumerate(row_k):
        if size < k:
            # topk breaks ties among equal scores (pooled scores, all-zero scores) differently for another k: a
            # row whose budget is smaller than the batch's largest takes its own topk, so that it keeps what it
            # keeps alone (row slices: no mask, so no further read back)
            top[b:b + 1] = F.pad(prio[b:b + 1].topk(size, dim=-1).indices, (0, k - size), value=T)
    # Entries past a row's n_keep are not kept: push them to the end, then restore original order.
    rank = torch.arange(k, device=scores.device).view(1, 1, -1)
    keep = rank < n_keep.unsqueeze(-1)
    top = torch.where(keep, top, T)
    index = top.sort(dim=-1).values
    last = index.gather(-1, (n_keep - 1).clamp(min=0).unsqueeze(-1))
    index = torch.where(index >= T, last, index)
    return index, n_keep


def pool1d(scores: Tensor, kernel_size: int, mode: str = "max") -> Tensor:
    """Same-length 1-D pooling along the last axis (SnapKV/EMS clustering of scores); odd kernels only."""
    if kernel_size <= 1:
        return scores
    if kernel_size % 2 == 0:
        raise ValueError(f"pooling kernel_size={kernel_size} must be odd")
    shape = scores.shape
    flat = scores.reshape(-1, 1, shape[-1]).float()
    pad = kernel_size // 2
    if mode == "max":
        out = torch.nn.functional.max_pool1d(flat, kernel_size, stride=1, padding=pad)
    elif mode == "mean":
        out = torch.nn.functional.avg_pool1d(flat, kernel_size, stride=1, padding=pad, count_include_pad=False)
    else:
        raise ValueError(f"pooling mode '{mode}'; accepted: max, mean")
    return out.reshape(shape).to(scores.dtype)


def topk_mask(scores: Tensor, count: Tensor) -> Tensor:
    """(B, H, T) bool: the ``count[b, h]`` highest finite scores of each row (ties -> the earlier slot).

    scores: (B, H, T), -inf marks entries that can never be chosen; count: (B, H) long. A row asking for
    more entries than it has finite scores gets only its finite ones.
    """
    order = torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device)
                                            .expand_as(order).contiguous())
    return (rank < count.unsqueeze(-1)) & torch.isfinite(scores)

