"""Chunked Soft Matching (Chelsea, Hu, Wang et al. §5.2).

Only in-chunk A x B cosines are computed: (n / c_s) chunks x (c_s / 2)^2 pairs, O(n c_s d / 4), never the
(n x n) matrix. Torch reference in float32; ``triton_matching`` holds the kernel of the same signature (see
``dispatch``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvbench.kernels.dispatch import use_triton
from kvbench.kernels.similarity import unit_keys


def chunked_soft_matching(
    keys: Tensor, start: Tensor, count: Tensor, chunk_size: int | None, longest: int | None = None
) -> tuple[Tensor, Tensor]:
    """Edges of one CSM step over the region ``[start, start + count)`` of every row.

    keys: (B, H, T, D); start, count: (B, H) long, the clusterable region of each row; ``longest``: count's
    maximum if the caller knows it on the host (else it is read back from the device).
    The region is cut into consecutive chunks of ``chunk_size`` slots (None: one chunk, i.e. no chunking).
    Inside a chunk, slots at even offsets form set A and slots at odd offsets set B (alternating partition);
    every A slot gets one edge to its most similar B slot of the same chunk (key cosine; ties -> the
    earliest B slot). An A slot whose chunk has no B slot gets no edge.

    Returns (partner, similarity), both (B, H, T):
      partner:    slot index of the edge's B end on A slots that have an edge, else -1;
      similarity: float32 cosine of that edge, -inf where there is no edge.
    """
    if use_triton("chunked_soft_matching", keys):
        from kvbench.kernels import triton_matching

        return triton_matching.chunked_soft_matching(keys, start, count, chunk_size, longest)
    B, H, T, D = keys.shape
    partner = torch.full((B, H, T + 1), -1, dtype=torch.long, device=keys.device)
    similarity = torch.full((B, H, T + 1), -float("inf"), device=keys.device)
    M = longest if longest is not None else int(count.max()) if count.numel() else 0
    if M < 2:
        return partner[..., :T], similarity[..., :T]
    size = M if chunk_size is None else min(chunk_size, M)
    n_chunks = -(-M // size)
    offset = torch.arange(n_chunks * size, device=keys.device).view(1, 1, -1)
    in_region = offset < count.unsqueeze(-1)  # (B, H, Mp)
    slot = (start.unsqueeze(-1) + offset).clamp(max=T - 1)
    unit = unit_keys(keys.gather(2, slot.unsqueeze(-1).expand(-1, -1, -1, D)))
    unit = unit * in_region.unsqueeze(-1)
    chunks = unit.view(B, H, n_chunks, size, D)
    sim = chunks[..., 0::2, :] @ chunks[..., 1::2, :].transpose(-1, -2)  # (B, H, C, |A|, |B|)
    b_real = in_region.view(B, H, n_chunks, size)[..., 1::2]
    sim = sim.masked_fill(~b_real.unsqueeze(-2), -float("inf"))
    best, arg = sim.max(-1)  # (B, H, C, |A|)
    a_offset = offset.view(1, 1, n_chunks, size)[..., 0::2]
    a_real = in_region.view(B, H, n_chunks, size)[..., 0::2]
    has_edge = a_real & torch.isfinite(best)
    chunk_base = (torch.arange(n_chunks, device=keys.device) * size).view(1, 1, -1, 1)
    a_slot = start.view(B, H, 1, 1) + a_offset
    b_slot = start.view(B, H, 1, 1) + chunk_base + 2 * arg + 1
    write_at = torch.where(has_edge, a_slot, torch.full_like(a_slot, T)).view(B, H, -1)
    partner.scatter_(2, write_at, torch.where(has_edge, b_slot, -1).view(B, H, -1))
    similarity.scatter_(2, write_at, torch.where(has_edge, best, -float("inf")).view(B, H, -1))
    return partner[..., :T], similarity[..., :T]

