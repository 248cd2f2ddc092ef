"""Host time of one layer's decode-step kernels, launched eagerly and under capture (nineteenth session): what a
graph's recording pays per layer for D2O's step, against the full cache's attention alone. The device is kept
busy (``torch.cuda._sleep``) so the host clock measures launching only.

    PYTHONPATH=/tmp/site:$PWD python3 results/gpu/2026-11-30/logs/s19_host_launch.py
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from kvbench.kernels import triton_decode
from kvbench.kernels.d2o_step import d2o_step
from scripts.bench_ems_kernels import layer

CALLS = 32


def host_us(call, capture: bool) -> float:
    call()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of device work ahead of the launches
        if capture:
            graph = torch.cuda.CUDAGraph()
            start = time.perf_counter()
            with torch.cuda.graph(graph):
                for _ in range(CALLS):
                    call()
            took = time.perf_counter() - start
        else:
            start = time.perf_counter()
            for _ in range(CALLS):
                call()
            took = time.perf_counter() - start
        torch.cuda.synchronize()
        best = min(best, took)
    return best / CALLS * 1e6


def main() -> None:
    device = torch.device("cuda")
    args = SimpleNamespace(rows=1, kv_heads=8, group=4, head_dim=128, slots=6555, context=32768, gamma=4.0,
                           table_fill=0.9, hot_share=0.0)
    s = layer(args, device)
    attention, threshold = s["state"][0], s["state"][1].zero_()
    logits = torch.randn(1, 32, args.slots, device=device) * 2
    pending = triton_decode.PendingStep(logits, logits.logsumexp(-1), args.group, args.slots)
    scaling = args.head_dim ** -0.5

    def d2o():
        d2o_step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], attention, threshold,
                 s["n_keep"], 3, 1, 4, 0.7, False, True, newest_last=True, step=pending)

    def attend():
        triton_decode.decode_attention(s["query"], s["keys"], s["values"], s["lengths"], s["positions"], None, scaling,
                                       args.slots, want_step=True, defer_step=True)

    def empty6():
        for _ in range(6):
            torch.empty(8 * 64, dtype=torch.long, device=device)

    for label, call in (("d2o_step (step fused)", d2o), ("decode_attention", attend), ("six torch.empty", empty6)):
        print(f"{label:>24}: eager {host_us(call, False):7.1f} us a call, captured {host_us(call, True):7.1f} us",
              flush=True)


if __name__ == "__main__":
    main()
