"""Token redundancy between two sets of cached tokens (EMS §4.1), and RoPE transfer between raw and rotated keys.

Redundancy is measured on raw (pre-RoPE) keys because the positional rotation attenuates the similarity of
tokens that are far apart. Merging in raw space then needs the merged raw key rotated back to a stored
position; methods never see the model's RoPE, so ``rotate_like`` reads the rotation off one token whose raw
and rotated keys are both known (RoPE is a per-pair planar rotation: the pair's phase difference is the angle).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvbench.kernels.dispatch import use_triton
from kvbench.kernels.similarity import unit_keys

SIMILARITIES = ("key_value", "key", "value")


def redundancy(keys_a: Tensor, values_a: Tensor, keys_b: Tensor, values_b: Tensor, similarity: str) -> Tensor:
    """R[i, j] between token i of set a and token j of set b: (B, H, M, D) x2, (B, H, N, D) x2 -> (B, H, M, N).

    similarity="key_value": cos(k_i, k_j) * cos(v_i, v_j) (EMS Eq. for R); "key" / "value": one factor alone.
    Each cosine is clamped at 0 first: the raw product would call two anti-parallel pairs (-0.8 * -0.8)
    redundant, and a weighted merge of opposite keys cancels them. With the clamp R lies in [0, 1], so
    tau = 0 merges every to-be-merged token, as EMS's tau sweep describes.
    """
    if similarity not in SIMILARITIES:
        raise ValueError(f"similarity '{similarity}'; accepted: {', '.join(SIMILARITIES)}")
    first, second = compared(keys_a, values_a, similarity), compared(keys_b, values_b, similarity)
    return unit_redundancy([unit_keys(x) for x in first], [unit_keys(x) for x in second])


def compared(keys: Tensor, values: Tensor, similarity: str) -> list[Tensor]:
    """The tensors whose cosines ``similarity`` multiplies: [keys, values], [keys] or [values]."""
    return {"key_value": [keys, values], "key": [keys], "value": [values]}[similarity]


def unit_redundancy(units_a: list[Tensor], units_b: list[Tensor], out: list[Tensor] | None = None) -> Tensor:
    """R of unit vectors: the product over the pairs (a, b) of max(0, a b^T), (B, H, M, N) float32.
    ``out``: (B, H, M, N) float32 blocks, one per pair, that the cosines are written into (R is the first); a
    caller that reuses them saves the page faults of a fresh block per call, which on the CPU cost about as
    much as the products."""
    products = [torch.matmul(a, b.transpose(-1, -2), out=None if out is None else block)
                for a, b, block in zip(units_a, units_b, out or [None] * len(units_a))]
    R = products[0].clamp_(min=0)
    for cosine in products[1:]:
        R.mul_(cosine.clamp_(min=0))
    return R


def most_redundant(raw_keys: Tensor, values: Tensor, sources: Tensor, source_count: Tensor, targets: Tensor,
                   target_count: Tensor, similarity: str, chunk: int = 512) -> tuple[Tensor, Tensor]:
    """Each source's most redundant target (EMS Eq. 5), ``chunk`` sources at a time: memory O(chunk x targets),
    never the whole (sources x targets) block (512: on the CPU 28 % faster than 1024 at EMS's 4k prompt on
    SmolLM2, 2,457 sources x 787 targets a head; the same float32 products at any chunk).

    raw_keys, values: (B, H, T, D); sources (B, H, M) and targets (B, H, C): slot indices, the first
    ``source_count`` / ``target_count`` (B, H) of each row real. Returns (best, match), both (B, H, M): the
    highest ``redundancy`` over the row's real targets (float32; -inf for a source that is not real or a row
    without targets) and that target's slot (ties: the earliest in ``targets``), -1 where best is -inf.
    ``triton_similarity.most_redundant`` is the kernel of the same signature (see ``dispatch``).
    """
    if use_triton("most_redundant", raw_keys):
        from kvbench.kernels import triton_similarity

        return triton_similarity.most_redundant(raw_keys, values, sources, source_count, targets, target_count,
                                                similarity, chunk)
    B, H, M = sources.shape
    best = torch.full((B, H, M), -float("inf"), device=raw_keys.device)
    match = torch.full((B, H, M), -1, dtype=torch.long, device=raw_keys.device)
    C = min(int(target_count.max()) if target_count.numel() else 0, targets.shape[-1])
    if M == 0 or C == 0:
        return best, match
    targets = targets[..., :C]
    target_ok = torch.arange(C, device=targets.device).view(1, 1, 1, -1) < target_count.view(B, H, 1, 1)

    def rows(x: Tensor, slots: Tensor) -> Tensor:
        return x.gather(2, slots.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))

    features = compared(raw_keys, values, similarity)
    target_units = [unit_keys(rows(x, targets)) for x in features]  # normalised once for every chunk
    blocks = [target_units[0].new_empty(B, H, min(chunk, M), C) for _ in features]  # reused by every chunk
    ragged = bool((target_count < C).any())  # else no target needs masking
    for start in range(0, M, chunk):
        part = sources[..., start:start + chunk]
        R = unit_redundancy([unit_keys(rows(x, part)) for x in features], target_units,
                            [block[..., :part.shape[-1], :] for block in blocks])
        top, arg = (R.masked_fill_(~target_ok, -float("inf")) if ragged else R).max(-1)  # (B, H, chunk)
        best[..., start:start + chunk] = top
        match[..., start:start + chunk] = torch.where(torch.isfinite(top), targets.gather(-1, arg), -1)
    real = torch.arange(M, device=sources.device).view(1, 1, -1) < source_count.unsqueeze(-1)
    return torch.where(real, best, -float("inf")), torch.where(real, match, -1)


def rotate_like(x: Tensor, raw: Tensor, rotated: Tensor, rel_eps: float = 1e-4) -> Tensor:
    """Apply to ``x`` the RoPE rotation that took ``raw`` to ``rotated`` (rotate_half layout, as Llama/Qwen).

    x, raw, rotated: (..., D). Dimension pairs (i, i + D/2) form complex numbers z; RoPE multiplies pair i by
    a unit phasor, recovered as z_rot * conj(z_raw) / |z_rot * z_raw|. A pair whose raw part is below
    ``rel_eps`` of the key's norm carries no usable phase and is left unrotated: that pair holds almost none
    of the reference key's energy. Computed in float32; returns x's dtype.
    """
    half = x.shape[-1] // 2
    xf, rf, pf = x.float(), raw.float(), rotated.float()
    r1, r2, p1, p2 = rf[..., :half], rf[..., half:], pf[..., :half], pf[..., half:]
    cos = p1 * r1 + p2 * r2
    sin = p2 * r1 - p1 * r2
    scale = torch.sqrt(cos * cos + sin * sin)
    usable = (r1 * r1 + r2 * r2).sqrt() > rel_eps * rf.norm(dim=-1, keepdim=True)
    cos = torch.where(usable, cos / scale.clamp(min=1e-30), torch.ones_like(cos))
    sin = torch.where(usable, sin / scale.clamp(min=1e-30), torch.zeros_like(sin))
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)
