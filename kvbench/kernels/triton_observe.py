"""Triton twin of ``observe.observe_pass``: one program per row finds the newest position, then adds the
attention and the observer counts to every slot."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from kvbench.kernels.triton_slots import check_storage, newest_position, scan_tile

BLOCK_C = 4096  # slots per tile
WARPS = 8


@triton.jit
def _observe_kernel(acc_ptr, obs_ptr, att_ptr, pos_ptr, len_ptr, queries_ptr, H, C, PER_ROW: tl.constexpr,
                    BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    length = tl.load(len_ptr + row)
    if PER_ROW:
        queries = tl.load(queries_ptr + row // H).to(tl.int64)
    else:
        queries = 1
    newest = newest_position(pos_ptr, row, length, C, BLOCK_C)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        inside = c < C
        at = row * C + c
        tl.store(acc_ptr + at, tl.load(acc_ptr + at, mask=inside) + tl.load(att_ptr + at, mask=inside), mask=inside)
        pos = tl.load(pos_ptr + at, mask=inside, other=0)
        seen = tl.where(c < length, tl.minimum(tl.maximum(newest - pos + 1, 0), queries), 0)
        tl.store(obs_ptr + at, tl.load(obs_ptr + at, mask=inside) + seen.to(tl.float32), mask=inside)


def observe_pass(accumulated: Tensor, observed: Tensor, attention: Tensor, positions: Tensor, lengths: Tensor,
                 num_queries: Tensor | None) -> None:
    B, H, C = positions.shape
    check_storage(accumulated, observed, attention, positions, lengths)
    per_row = num_queries is not None
    _observe_kernel[(B * H,)](accumulated, observed, attention, positions, lengths,
                              num_queries.contiguous() if per_row else lengths, H, C, PER_ROW=per_row,
                              BLOCK_C=scan_tile(C, BLOCK_C), num_warps=WARPS)
