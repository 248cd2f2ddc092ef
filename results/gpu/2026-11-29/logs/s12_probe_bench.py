"""D2O's one-query attention and step, key probe off and on, one layer, replayed from a CUDA graph (2026-11-29 s12).

    python results/gpu/2026-11-29/logs/s12_probe_bench.py 1:13108:65536 104:3277:16384   # rows:slots:context
    python results/gpu/2026-11-29/logs/s12_probe_bench.py --waves 2,4,8 1:6555:32768 1:13108:65536

Each shape: the attention alone, then the attention and ``d2o_step`` (whose previous call leaves the next hints:
its runner-up), without and with a ``KeyProbe``; per-kernel device times from ``scripts.bench_ems_kernels.timed``.
``--waves``: instead, the attention alone (no probe) at each ``triton_decode.WAVES`` (more, shorter splits: at
batch one each program's chain of dependent loads, not the bytes, may set the time).
"""
import sys

import torch

from kvbench.kernels import triton_decode
from kvbench.kernels.d2o_step import d2o_step
from kvbench.kernels.decode_attention import KeyProbe
from scripts.bench_ems_kernels import timed


def run(rows: int, slots: int, context: int, waves: list[int]) -> None:
    g = torch.Generator(device="cpu").manual_seed(0)
    B, H, C, D = rows, 8, slots, 128
    pos = torch.sort(torch.randperm(context - 1, generator=g)[:C - 1]).values
    pos = torch.cat([pos, torch.tensor([context - 1])]).expand(B, H, C).contiguous().cuda()
    keys = torch.randn(B, H, C, D, generator=g).to("cuda", torch.bfloat16)
    values = torch.randn(B, H, C, D, generator=g).to("cuda", torch.bfloat16)
    lengths = torch.full((B, H), C, device="cuda")
    state = torch.rand(2, B, H, C, generator=g).cuda()
    n_keep = torch.full((B,), C - 1, device="cuda")
    query = torch.randn(B, H * 4, 1, D, generator=g).to("cuda", torch.bfloat16)
    hints = torch.full((B, H, 2), -1, dtype=torch.int32, device="cuda")
    for count in waves:
        triton_decode.WAVES = count
        triton_decode._programs_wanted.cache_clear()
        print(f"== {rows} x 8 x {slots}: {count} waves")
        lines = timed(lambda: triton_decode.decode_attention(query, keys, values, lengths, pos, None, D ** -0.5, C,
                                                            want_step=True, defer_step=True), "attention")
        print("\n".join(lines), flush=True)
    if waves:
        return
    for probing in (False, True):
        for with_step in (False, True):
            def call():
                probe = KeyProbe(hints) if probing else None
                triton_decode.decode_attention(query, keys, values, lengths, pos, None, D ** -0.5, C,
                                               want_step=with_step, defer_step=True, probe=probe)
                if with_step:
                    d2o_step(keys, values, pos, lengths, state, state[0], state[1].zero_(), n_keep, 3, 1, 4, 0.7,
                             False, True, newest_last=True, probe=probe)
                    lengths.fill_(C)
            print(f"== {rows} x 8 x {slots}: probe {probing}, step {with_step}")
            print("\n".join(timed(call, "attention" + (" + d2o_step" if with_step else ""))), flush=True)


args = sys.argv[1:]
wave_counts = [int(n) for n in args[1].split(",")] if args[:1] == ["--waves"] else []
for spec in args[2:] if wave_counts else args:
    run(*map(int, spec.split(":")), wave_counts)
