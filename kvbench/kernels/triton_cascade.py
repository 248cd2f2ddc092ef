"""Triton twins of ``cascade.block_solve`` and ``cascade.carry_states``: same signatures, float32.

- ``_block_solve``: one program per (block, column tile) runs the block's forward substitution row by row
  with the block's right-hand side and coefficients in registers; the contributions c_r x_r still owed to
  the next ``width`` rows wait in a ring of ``width`` accumulators (row r reads and clears ring entry r mod
  width, then every entry takes c_r x_r), so a row's sum comes in the order a sequential solve adds it.
- ``_carry_states``: one program per (row, column tile) walks the blocks in order, s <- M_b s + u_b, with
  the state in registers: one launch for what would be a loop of small products per block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_C = 32  # columns per program


@triton.jit
def _block_solve(
    c_ptr, rhs_ptr, out_ptr, S, C, width, scn, scs, srn, srs, src, son, sos, soc,
    BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
):
    n = tl.program_id(0)
    rows = tl.arange(0, BLOCK_S)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ring = tl.arange(0, BLOCK_W)
    coefficient = tl.load(c_ptr + n * scn + rows * scs, mask=rows < S, other=0.0)
    rhs = tl.load(rhs_ptr + n * srn + rows[:, None] * srs + cols[None, :] * src,
                  mask=(rows[:, None] < S) & (cols[None, :] < C), other=0.0)
    owed = tl.zeros((BLOCK_W, BLOCK_C), tl.float32)
    for r in range(0, S):
        entry = (ring == r % width)[:, None]
        x = tl.sum(tl.where(rows[:, None] == r, rhs, 0.0), 0) + tl.sum(tl.where(entry, owed, 0.0), 0)
        c_r = tl.sum(tl.where(rows == r, coefficient, 0.0), 0)
        owed = tl.where(entry, 0.0, owed) + c_r * x[None, :]
        tl.store(out_ptr + n * son + r * sos + cols * soc, x, mask=cols < C)


@triton.jit
def _carry_states(
    m_ptr, u_ptr, out_ptr, blocks, width, C, smn, smb, smr, smc, sun, sub, sur, suc, son, sob, sor, soc,
    BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
):
    n = tl.program_id(0)
    ring = tl.arange(0, BLOCK_W)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    square = (ring[:, None] < width) & (ring[None, :] < width)
    tall = (ring[:, None] < width) & (cols[None, :] < C)
    state = tl.zeros((BLOCK_W, BLOCK_C), tl.float32)
    for b in range(0, blocks):
        tl.store(out_ptr + n * son + b * sob + ring[:, None] * sor + cols[None, :] * soc, state, mask=tall)
        m = tl.load(m_ptr + n * smn + b * smb + ring[:, None] * smr + ring[None, :] * smc, mask=square, other=0.0)
        u = tl.load(u_ptr + n * sun + b * sub + ring[:, None] * sur + cols[None, :] * suc, mask=tall, other=0.0)
        state = tl.dot(m, state, input_precision="ieee") + u


def block_solve(coefficient: Tensor, rhs: Tensor, width: int) -> Tensor:
    """Triton ``cascade.block_solve``: coefficient (N, S), rhs (N, S, C) float32 -> (N, S, C)."""
    N, S, C = rhs.shape
    out = torch.empty_like(rhs)
    if N and S and C:
        _block_solve[(N, triton.cdiv(C, BLOCK_C))](
            coefficient, rhs, out, S, C, width, *coefficient.stride(), *rhs.stride(), *out.stride(),
            BLOCK_S=triton.next_power_of_2(S), BLOCK_W=triton.next_power_of_2(width), BLOCK_C=BLOCK_C,
        )
    return out


def carry_states(matrix: Tensor, state: Tensor) -> Tensor:
    """Triton ``cascade.carry_states``: matrix (N, blocks, n, n), state (N, blocks, n, C) -> (N, blocks, n, C)."""
    N, blocks, width, C = state.shape
    out = torch.empty(state.shape, dtype=torch.float32, device=state.device)
    if N and blocks and C:
        _carry_states[(N, triton.cdiv(C, BLOCK_C))](
            matrix, state, out, blocks, width, C, *matrix.stride(), *state.stride(), *out.stride(),
            BLOCK_W=max(16, triton.next_power_of_2(width)), BLOCK_C=BLOCK_C,
        )
    return out
