"""Triton twin of ``observe.observe_pass`` over blocks of each row: the newest position per block
(``triton_slots.newest_by_blocks``), then one program per (row, block) adds the attention and the observer counts
to its slots, the row's newest being the blocks' (two launches; one program per row scanning the whole row twice
was latency-bound at a batch of one). One query a row (a decode step, ``num_queries=None``) saw every real slot
once: every real position is at most the row's newest, so min(newest - position + 1, 1) = 1, and the pass needs
neither the newest nor the positions (one launch; at 64 rows x 8 heads x 3,277 slots on an H200 the newest scan was
18 us a layer, and the positions a third of the observation's reads)."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from kvbench.kernels.triton_slots import (BLOCK_SCAN, block_size, check_storage, newest_by_blocks, newest_of_blocks,
                                          row_blocks)


@triton.jit
def _observe_kernel(acc_ptr, obs_ptr, att_ptr, pos_ptr, len_ptr, queries_ptr, newest_ptr, H, C, span, NB,
                    PER_ROW: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_NB: tl.constexpr):
    row, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    length = tl.load(len_ptr + row)
    if PER_ROW:
        queries = tl.load(queries_ptr + row // H).to(tl.int64)
        newest = newest_of_blocks(newest_ptr, row, NB, BLOCK_NB)
    start = block * span
    stop = tl.minimum(start + span, C)
    for c0 in range(start, stop, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        inside = c < stop
        at = row * C + c
        tl.store(acc_ptr + at, tl.load(acc_ptr + at, mask=inside) + tl.load(att_ptr + at, mask=inside), mask=inside)
        if PER_ROW:
            pos = tl.load(pos_ptr + at, mask=inside, other=0)
            seen = tl.where(c < length, tl.minimum(tl.maximum(newest - pos + 1, 0), queries), 0)
        else:  # one query: every real slot saw it (module docstring)
            seen = (c < length).to(tl.int64)
        tl.store(obs_ptr + at, tl.load(obs_ptr + at, mask=inside) + seen.to(tl.float32), mask=inside)


def observe_pass(accumulated: Tensor, observed: Tensor, attention: Tensor, positions: Tensor, lengths: Tensor,
                 num_queries: Tensor | None) -> None:
    B, H, C = positions.shape
    check_storage(accumulated, observed, attention, positions, lengths)
    per_row = num_queries is not None
    NB, span = row_blocks(B * H, C, BLOCK_SCAN, positions.device)
    newest = newest_by_blocks(positions, lengths, NB, span, wanted=per_row)
    _observe_kernel[(B * H, NB)](accumulated, observed, attention, positions, lengths,
                                 num_queries.contiguous() if per_row else lengths, newest, H, C, span, NB,
                                 PER_ROW=per_row, BLOCK_C=BLOCK_SCAN, BLOCK_NB=block_size(NB))
