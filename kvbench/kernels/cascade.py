"""A banded linear recurrence along each row, solved by independent blocks and a carry across them.

    x_s = v_s + sum over k = 1..width of c_{s-k} x_{s-k}        (s = 0 .. T-1; x, v: (D,) vectors, c: scalars)

is the unit lower-triangular system (I - N) x = v of bandwidth ``width``, N[s, s - k] = c_{s-k}. CaM's merge
cascade is one (every slot that leaves adds c x to the ``width`` slots after it). Cut into blocks of S >= width
slots, block b is L_b x_b = v_b + P_b s_{b-1}, where s_{b-1} is the previous block's last ``width`` values and
P_b their coupling into it; so ``block_solve`` solves every block alone, [y_b | W_b] = L_b^{-1} [v_b | P_b],
``carry_states`` runs s_b = W_b[-width:] s_{b-1} + y_b[-width:] along the blocks (n x n maps, cheap), and
x_b = y_b + W_b s_{b-1}. Torch references; ``triton_cascade`` holds one-launch kernels of the same
signatures (see ``dispatch``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvbench.kernels.dispatch import use_triton


def block_solve(coefficient: Tensor, rhs: Tensor, width: int) -> Tensor:
    """Every block alone: coefficient (N, S), rhs (N, S, C) float32 -> x (N, S, C) with
    x_r = rhs_r + sum over k = 1..min(width, r) of c_{r-k} x_{r-k}."""
    if use_triton("block_solve", rhs):
        from kvbench.kernels import triton_cascade

        return triton_cascade.block_solve(coefficient, rhs, width)
    size = coefficient.shape[-1]
    row = torch.arange(size, device=rhs.device)
    gap = row.view(-1, 1) - row.view(1, -1)
    lower = torch.eye(size, device=rhs.device) - ((gap >= 1) & (gap <= width)) * coefficient.unsqueeze(-2)
    return torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)


def carry_states(matrix: Tensor, state: Tensor) -> Tensor:
    """The state entering each block of s_b = matrix_b s_{b-1} + state_b, s_{-1} = 0: matrix (N, blocks, n, n),
    state (N, blocks, n, C) float32 -> (N, blocks, n, C), zeros for the first block."""
    if use_triton("carry_states", state):
        from kvbench.kernels import triton_cascade

        return triton_cascade.carry_states(matrix, state)
    entering = torch.zeros_like(state)
    for block in range(1, state.shape[1]):
        entering[:, block] = matrix[:, block - 1] @ entering[:, block - 1] + state[:, block - 1]
    return entering


def banded_cascade(values: Tensor, coefficient: Tensor, width: int, block: int = 64) -> Tensor:
    """Solve x_s = v_s + sum_{k=1..width} c_{s-k} x_{s-k} along the third axis: values (B, H, T, D) float32,
    coefficient c (B, H, T) -> x (B, H, T, D), in blocks of max(block, width) slots. The sums are associated
    differently from a slot-by-slot solve: results agree with it to float rounding."""
    B, H, T, D = values.shape
    size = max(block, width)
    blocks = -(-T // size)
    if blocks == 0:
        return values.clone()
    pad = blocks * size - T
    v = F.pad(values, (0, 0, 0, pad)).view(B * H, blocks, size, D)
    c = F.pad(coefficient.to(values.dtype), (0, pad)).view(B * H, blocks, size)
    # slot r of a block and slot S - width + m of the previous one are r + width - m apart: coupled iff r <= m
    previous = F.pad(c[:, :-1, size - width:], (0, 0, 1, 0))  # (BH, blocks, width), none before block 0
    row = torch.arange(size, device=values.device)
    coupling = (row.view(-1, 1) <= row[:width].view(1, -1)) * previous.unsqueeze(-2)  # (BH, blocks, S, width)
    solved = block_solve(c.reshape(-1, size), torch.cat([v, coupling], -1).view(-1, size, D + width), width)
    solved = solved.view(B * H, blocks, size, D + width)
    y, w = solved[..., :D], solved[..., D:]
    entering = carry_states(w[:, :, size - width:], y[:, :, size - width:])  # (BH, blocks, width, D)
    return torch.baddbmm(y.reshape(-1, size, D), w.reshape(-1, size, width),
                         entering.reshape(-1, width, D)).view(B, H, blocks * size, D)[:, :, :T]
