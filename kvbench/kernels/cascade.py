"""A banded linear recurrence along each row, solved with batched matrix products instead of a loop over the row.

    x_s = v_s + sum over k = 1..width of c_{s-k} x_{s-k}        (s = 0 .. T-1; x, v: (D,) vectors, c: scalars)

is the unit lower-triangular system (I - N) x = v of bandwidth ``width``, N[s, s - k] = c_{s-k}. CaM's merge
cascade is one (every slot that leaves adds c x to the ``width`` slots after it). Torch only: the work is a
handful of batched GEMMs (cuBLAS on a GPU), no kernel of its own needed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def unit_lower_inverse(strict: Tensor) -> Tensor:
    """(..., S, S) strictly lower-triangular N, S a power of two -> (I - N)^{-1}, built from the diagonal up:
    [[A, 0], [C, D]]^{-1} = [[A^{-1}, 0], [-D^{-1} C A^{-1}, D^{-1}]] with C = -N's block (log2 S batched levels,
    O(S^3) work per matrix; no subtraction when N >= 0, so no cancellation)."""
    *batch, size, _ = strict.shape
    inverse = strict.new_ones(*batch, size, 1, 1)  # the diagonal blocks of size 1
    half = 1
    while half < size:
        pairs = size // (2 * half)
        blocks = strict.reshape(*batch, pairs, 2 * half, pairs, 2 * half).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)
        top, bottom = inverse.view(*batch, pairs, 2, half, half).unbind(-3)
        coupled = bottom @ blocks[..., half:, :half] @ top
        inverse = torch.cat([torch.cat([top, torch.zeros_like(top)], -1), torch.cat([coupled, bottom], -1)], -2)
        half *= 2
    return inverse.squeeze(-3)


def banded_cascade(values: Tensor, coefficient: Tensor, width: int, block: int = 64) -> Tensor:
    """Solve x_s = v_s + sum_{k=1..width} c_{s-k} x_{s-k} along the third axis: values (B, H, T, D) float,
    coefficient c (B, H, T) -> x (B, H, T, D).

    Every diagonal block of S slots (S >= width, a power of two >= ``block``) is solved alone at once:
    [y_b | W_b] = L_b^{-1} [v_b | P_b], P_b the coupling of the previous block's last ``width`` slots. The last
    ``width`` rows of each block then follow the affine maps s_b = W_b[-width:] s_{b-1} + y_b[-width:], composed
    by an inclusive (Hillis-Steele) scan over the blocks in log2(T / S) batched steps, and x_b = y_b + W_b s_{b-1}.
    The sums are associated differently from a sequential solve: results agree with it to float rounding."""
    B, H, T, D = values.shape
    size = 1 << (max(block, width) - 1).bit_length()
    blocks = -(-T // size)
    if blocks == 0:
        return values.clone()
    pad = blocks * size - T
    v = F.pad(values, (0, 0, 0, pad)).view(B, H, blocks, size, D)
    c = F.pad(coefficient.to(values.dtype), (0, pad)).view(B, H, blocks, size)
    row = torch.arange(size, device=values.device)
    gap = row.view(-1, 1) - row.view(1, -1)
    inverse = unit_lower_inverse(((gap >= 1) & (gap <= width)) * c.unsqueeze(-2))  # (B, H, blocks, S, S)
    # slot r of a block and slot S - width + m of the previous one are r + width - m apart: coupled iff r <= m
    previous = F.pad(c[:, :, :-1, size - width:], (0, 0, 1, 0))  # (B, H, blocks, width), none before block 0
    coupling = (row.view(-1, 1) <= row[:width].view(1, -1)) * previous.unsqueeze(-2)  # (B, H, blocks, S, width)
    solved = inverse @ torch.cat([v, coupling], -1)
    y, w = solved[..., :D], solved[..., D:]
    matrix, state = w[..., size - width:, :], y[..., size - width:, :]  # s_b = matrix_b s_{b-1} + state_b
    step = 1
    while step < blocks:  # entry b composes the maps of blocks (b - 2 step, b]
        state = torch.cat([state[:, :, :step], matrix[:, :, step:] @ state[:, :, :-step] + state[:, :, step:]], 2)
        matrix = torch.cat([matrix[:, :, :step], matrix[:, :, step:] @ matrix[:, :, :-step]], 2)
        step *= 2
    entering = F.pad(state[:, :, :-1], (0, 0, 0, 0, 1, 0))  # s_{b-1}: 0 before the first block
    return (y + w @ entering).reshape(B, H, blocks * size, D)[:, :, :T]
