"""EMS's fused decode step (one layer, Llama-3.1-8B shape: 8 KV heads, d 128, bf16, the look-up table at gamma 4 half
full) timed as graph replays of 8 steps, for tile sizes of its block-split phases (``triton_ems_step.BLOCK_S``,
``WARPS``) and ``triton_slots.PROGRAMS_PER_SM``, with RoPE taken off in registers (the engine's path) and with raw
keys given. One process (call 33):

    PYTHONPATH=/tmp/site:. python3 results/gpu/2026-11-27/logs/ems_step_tiles_call33.py
"""
import itertools
from types import SimpleNamespace

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kvbench.attention import Rope
from kvbench.kernels import triton_ems_step, triton_slots

config = LlamaConfig(hidden_size=4096, num_attention_heads=32, head_dim=128, max_position_embeddings=131072,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192})
rope = Rope(SimpleNamespace(config=config, model=SimpleNamespace(rotary_emb=LlamaRotaryEmbedding(config).cuda())))
rope.table(torch.bfloat16)


def layer(B, n, H=8, D=128):
    g = torch.Generator(device="cpu").manual_seed(n)
    keys = torch.randn(B, H, n, D, generator=g).cuda().bfloat16()
    positions = torch.arange(n, device="cuda").expand(B, H, n).contiguous() * 5  # a 32k prompt's kept tokens
    E = 3 * (n - 1)
    entry = torch.arange(E, device="cuda").expand(B, H, E)
    used = entry < E // 2
    lut = (torch.where(used, 5 * n + entry, -1), torch.where(used, (entry % n) * 5, -1),
           torch.where(used, 1.0, -1.0).float())
    return dict(keys=keys, values=torch.randn(B, H, n, D, generator=g).cuda().bfloat16(),
                raw=rope.unrotate(keys, positions), positions=positions, lengths=torch.full((B, H), n, device="cuda"),
                state=torch.rand(5, B, H, n, generator=g).cuda(), n_keep=torch.full((B,), n - 1, device="cuda"),
                lut=lut)


def timed(s, in_registers):
    def step():
        triton_ems_step.ems_step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"],
                                 None if in_registers else s["raw"], tuple(s["state"][:3]),
                                 (s["state"][3], s["state"][4], None), s["lut"], s["n_keep"], 32, 0.0, 4.0,
                                 "key_value", False, rope)
    step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(8):
            step()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(4):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / 32)
    return best


print("| rows x slots | BLOCK_S | warps | programs/SM | in registers us | raw keys given us |")
print("|---|---:|---:|---:|---:|---:|")
for B, n in ((1, 6554), (8, 3277)):
    for block_s, warps, per_sm in itertools.product((16, 32, 64), (4, 8), (4, 8, 16)):
        triton_ems_step.BLOCK_S, triton_ems_step.WARPS, triton_slots.PROGRAMS_PER_SM = block_s, warps, per_sm
        times = [timed(layer(B, n), mode) for mode in (True, False)]
        print(f"| {B} x {n} | {block_s} | {warps} | {per_sm} | {times[0]:.1f} | {times[1]:.1f} |", flush=True)
