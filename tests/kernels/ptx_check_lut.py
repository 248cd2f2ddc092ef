"""Compile EMS's expansion kernels (``kvbench.kernels.triton_lut_expand``, ``triton_lut_attention``) to PTX and
cubin for sm_90 without a GPU, as ``ptx_check.py`` does for the fused decode steps (its launch stand-in). Run
without TRITON_INTERPRET:
    PYTHONPATH=. python tests/kernels/ptx_check_lut.py
Prints the number of variants compiled; a compile error exits non-zero with Triton's message.
"""

from __future__ import annotations

import os

import torch
from triton.runtime.jit import JITFunction

from tests.kernels import ptx_check


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") != "1", "the interpreter does not compile"
    JITFunction.run = ptx_check.compile_instead_of_launch
    from kvbench.kernels import triton_lut_attention, triton_lut_expand

    B, H, T, E, D = 1, 8, 300, 900, 128
    keys, values = torch.randn(B, H, T, D).bfloat16(), torch.randn(B, H, T, D).bfloat16()
    positions, lengths = torch.arange(T).expand(B, H, T).contiguous(), torch.full((B, H), T)
    slot, live = torch.zeros(B, H, E, dtype=torch.long), torch.ones(B, H, E, dtype=torch.bool)
    table = (torch.full((B, H, E), 5), torch.full((B, H, E), 2.0))
    for member_keys in (None, torch.randn(B, H, E, D).bfloat16()):
        triton_lut_expand.expand_lut(keys, values, positions, lengths, slot, live, *table, member_keys)
    triton_lut_expand.fold_entries(torch.rand(B, H, T + E), torch.zeros(B, H, T + E, dtype=torch.long), lengths, T)
    triton_lut_expand.centre_slots(positions, lengths, table[0])
    for group in (1, 4):  # the members' attention, with and without its step attention
        query = torch.randn(B, H * group, 1, D).bfloat16()
        triton_lut_attention.lut_attention(query, keys, values, lengths, slot, table[1], live, 0.1, group == 4)
        triton_lut_attention.lut_attention_at_centres(query, keys, values, positions, lengths, table[0], table[1], T,
                                                      0.1, group == 4)
    print(f"{len(ptx_check.compiled)} kernel variants compiled for sm_90: {sorted(set(ptx_check.compiled))}")


if __name__ == "__main__":
    main()
