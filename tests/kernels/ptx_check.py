"""Compile the fused decode-step kernels and Chelsea's prompt matching and merge to PTX and cubin for an H100 (sm_90),
without a GPU.

Triton's interpreter (what the CPU tests run) accepts code the compiler refuses (plain Python globals, some
scalar forms), so every launch of the wrappers below is turned into a compilation with the launch's real
argument types and constexprs. Run without TRITON_INTERPRET (``test_decode_steps`` runs it in a child
process):
    PYTHONPATH=. python tests/kernels/ptx_check.py
Prints the number of variants compiled; a compile error exits non-zero with Triton's message. D2O's streamed best
match must give the tiled one's bits: every float sum of both must have the same layout (which fixes the order of
its additions) wherever ``triton_d2o_step.streamed_match`` lets it run, or the check fails.
"""

from __future__ import annotations

import itertools
import os
import re
from types import SimpleNamespace

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
POINTERS = {torch.float64: "*fp64", torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16",
            torch.int64: "*i64", torch.int32: "*i32", torch.int8: "*i8", torch.bool: "*i1"}
compiled: list[str] = []
ttgir: dict[str, str] = {}  # each kernel's last compilation, in Triton's GPU dialect


def compile_instead_of_launch(self, *args, grid, warmup, **kwargs):
    """JITFunction.run's stand-in: the signature of this launch, compiled for TARGET."""
    bound = dict(zip(self.arg_names, args)) | {k: v for k, v in kwargs.items() if k in self.arg_names}
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(self.params):
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = POINTERS[value.dtype]
        elif isinstance(value, int):
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
        else:
            signature[param.name] = "fp32"
        # a launch's alignment specialisation, as the JIT makes it: with it the compiler vectorises loads, and the
        # vector width shapes each tile's layout (hence its sums' order)
        address = value.data_ptr() if isinstance(value, torch.Tensor) else value
        if not param.is_constexpr and not param.do_not_specialize and isinstance(address, int) and address % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: v for k, v in kwargs.items() if k in ("num_warps", "enable_fp_fusion")}
    kernel = triton.compile(ASTSource(self, signature, constexprs, attrs), target=TARGET, options=options)
    compiled.append(self.fn.__name__)
    ttgir[self.fn.__name__] = kernel.asm["ttgir"]


def float_sums(code: str, rows: int) -> set[str]:
    """Each float sum's axis and operand layout in a kernel's TTGIR, its tile's ``rows`` written S: the layout
    fixes the order of the additions, so two kernels whose sums have the same layouts round them alike."""
    layouts = dict(re.findall(r"^(#blocked\d*) = #ttg.blocked(<\{[^}]*\}>)", code, re.M))
    lines, sums = code.splitlines(), set()
    for i, line in enumerate(lines):
        if '"tt.reduce"' not in line:
            continue
        end = next(j for j in range(i, len(lines)) if "}) :" in lines[j])
        if "arith.addf" in " ".join(lines[i:end]):
            operand = re.sub(r"#blocked\d*", lambda name: layouts[name.group(0)], lines[end].split("}) :")[1])
            shape = re.sub(f"<{rows}x(?=\\d)", "<Sx", operand.split("->")[0])  # the tile's rows, not a 1-D length
            sums.add(re.search(r"axis = \d+", line).group(0) + shape)
    return sums


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") != "1", "the interpreter does not compile"
    JITFunction.run = compile_instead_of_launch
    from kvbench.kernels import (triton_cam_step, triton_d2o_step, triton_ems_step, triton_observe, triton_partner_merge,
                                 triton_slots)
    from kvbench.kernels import triton_decode, triton_matching, triton_weightedkv_step

    B, H, C, D = 2, 8, 300, 128
    keys, values = torch.randn(B, H, C, D).bfloat16(), torch.randn(B, H, C, D).bfloat16()
    positions, lengths = torch.arange(C).expand(B, H, C).contiguous(), torch.full((B, H), C)
    state, n_keep = torch.rand(6, B, H, C), torch.full((B,), C - 1)
    layer = (keys, values, positions, lengths, state)
    triton_weightedkv_step.weightedkv_step(*layer, state[0], state[1], n_keep, 4, None)
    triton_weightedkv_step.weightedkv_step(*layer, state[0], state[1], n_keep, 1, 1)
    triton_cam_step.cam_step(*layer, state[0], n_keep, 4, None, 16, 2**31 + 5)
    triton_cam_step.cam_step(*layer, state[0], n_keep, 1, 0.5, 1, None)
    long_row = (torch.randn(1, 1, 9000, 16), torch.randn(1, 1, 9000, 16), torch.arange(9000).view(1, 1, 9000),
                torch.full((1, 1), 9000), torch.rand(2, 1, 1, 9000))  # more slots than a tile: the scans loop
    triton_cam_step.cam_step(*long_row, long_row[-1][0], torch.full((1,), 8999), 4, 0.5, 16, None)
    triton_weightedkv_step.weightedkv_step(*long_row, long_row[-1][0], long_row[-1][1], torch.full((1,), 8999), 4,
                                           None)
    triton_slots.evict_in_budget(state[0], lengths, positions, n_keep, 4, 0.5, keys, values, state)  # H2O
    triton_slots.evict_in_budget(None, lengths, positions, n_keep, 4, None, keys, values, state)  # StreamingLLM
    none = torch.zeros(B, H, dtype=torch.long)
    triton_slots.evict_lowest(state[0][:, :1].expand(B, H, C), lengths, positions, none, none, keys, values, state)
    triton_d2o_step.d2o_step(*layer, state[0], state[1], n_keep, 3, 1, 4, 0.7, False, True)
    triton_d2o_step.d2o_step(*layer, state[0], state[1], n_keep, 3, 1, 1, 0.7, True, False)
    pending = triton_decode.PendingStep(torch.randn(B, 4 * H, C), torch.randn(B, 4 * H), 4, C)
    triton_d2o_step.d2o_step(*layer, state[0], state[1], n_keep, 3, 1, 4, 0.7, False, True, newest_last=True,
                             step=pending)  # the step attention made in the step's first launch
    streamed_variants = 0
    # head dims of Llama, SmolLM2, Phi-2 (80), ... and 16, which the tiled kernel must take in 16 bits
    for head_dim, dtype in itertools.product((16, 32, 64, 80, 96, 128), (torch.bfloat16, torch.float16, torch.float32)):
        if not triton_d2o_step.streamed_match(2**62, head_dim, dtype.itemsize):
            continue  # the tiled kernel runs
        d2o_layer = (keys[..., :head_dim].to(dtype).contiguous(), values.to(dtype), *layer[2:])
        for min_span in (0, 2**62):  # the streamed best match, then the tiled one, on the same keys
            triton_d2o_step.STREAMED_MIN_SPAN = min_span
            triton_d2o_step.d2o_step(*d2o_layer, state[0], state[1], n_keep, 3, 1, 4, 0.7, False, True)
        streamed, tiled = (float_sums(ttgir[name], rows) for name, rows in (
            ("_match_streamed_kernel", triton_d2o_step.STREAMED_TILE[0]), ("_match_kernel", triton_d2o_step.BLOCK_S)))
        assert streamed == tiled, f"D2O's streamed best match sums in other layouts ({head_dim}, {dtype}): " \
                                  f"{streamed ^ tiled}"
        streamed_variants += 1
    assert streamed_variants == 16, streamed_variants  # all but head dim 16 in 16 bits
    table = (torch.full((B, H, 900), -1), torch.full((B, H, 900), -1), torch.full((B, H, 900), -1.0))
    for lut, gamma, similarity, with_positions, bias in ((table, 4.0, "key_value", False, None),
                                                          (None, float("inf"), "key", True, state[5]),
                                                          (None, 1.0, "value", False, state[5])):
        triton_ems_step.ems_step(*layer, keys, tuple(state[:3]), (state[3], state[4], bias), lut, n_keep, 32, 0.6,
                                 gamma, similarity, with_positions)
    rope = SimpleNamespace(frequencies=(torch.rand(D // 2), 1.0),  # RoPE taken off in registers (16-bit keys)
                           table=lambda dtype: (torch.rand(64, D // 2).to(dtype), torch.rand(64, D // 2).to(dtype)))
    for dtype in (torch.bfloat16, torch.float16):
        triton_ems_step.ems_step(keys.to(dtype), values.to(dtype), *layer[2:], None, tuple(state[:3]),
                                 (state[3], state[4], None), table, n_keep, 32, 0.6, 4.0, "key_value", False, rope)
    triton_ems_step.ems_observe(*state[:5], lengths, 32)
    triton_observe.observe_pass(state[0], state[1], state[2], positions, lengths, None)
    triton_observe.observe_pass(state[0], state[1], state[2], positions, lengths, torch.ones(B, dtype=torch.long))
    absorbed, partner = positions % 2 == 0, (positions | 1).clamp(max=C - 1)  # Chelsea's prompt merge
    triton_partner_merge.merge_into_partners(keys, values, positions, state[0], lengths, absorbed, partner, C // 2)
    triton_matching.chunked_soft_matching(keys, torch.zeros(B, H, dtype=torch.long), lengths, 256)  # its edges
    print(f"{len(compiled)} kernel variants compiled for sm_90: {sorted(set(compiled))}")


if __name__ == "__main__":
    main()
