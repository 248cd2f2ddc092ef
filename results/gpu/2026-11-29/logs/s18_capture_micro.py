"""Host time of the pieces of a lane-using decode step's recording, alone (no model): per layer, the fork to a side
lane (``engine.LayerLanes``) inside inference mode, six ``torch.empty`` on the lane or on the captured stream, and
one Triton launch of D2O's step kernels' size of argument list; under a CUDA graph's capture against eager.

    PYTHONPATH=/tmp/site:$PWD python3 results/gpu/2026-11-29/logs/s18_capture_micro.py
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

from kvbench.engine import LAYER_STREAMS, LayerLanes
from kvbench.graphs import capture_stream


@triton.jit
def _many_args(a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, BLOCK: tl.constexpr):
    x = tl.arange(0, BLOCK)
    tl.store(a + x, tl.load(b + x) + q + r + s)


def pieces(device, layers=32):
    lanes = LayerLanes(device, LAYER_STREAMS)
    bufs = [torch.zeros(16, device=device) for _ in range(8)]

    def fork_only():
        for index in range(layers):
            with torch.inference_mode(), lanes.fork(index):
                pass
        lanes.join()

    def fork_empties():
        for index in range(layers):
            with torch.inference_mode(), lanes.fork(index):
                for _ in range(6):
                    torch.empty(8, 40, dtype=torch.long, device=device)
        lanes.join()

    def main_empties():
        for index in range(layers):
            for _ in range(6):
                torch.empty(8, 40, dtype=torch.long, device=device)

    def fork_one_empty():
        for index in range(layers):
            with torch.inference_mode(), lanes.fork(index):
                torch.empty(6 * 8 * 40, dtype=torch.long, device=device)
        lanes.join()

    def launches():
        for index in range(layers):
            for _ in range(3):
                _many_args[(8, 4)](*bufs, *bufs, 1, 2, 3, 4, BLOCK=16)

    def fork_launches():
        for index in range(layers):
            with torch.inference_mode(), lanes.fork(index):
                for _ in range(3):
                    _many_args[(8, 4)](*bufs, *bufs, 1, 2, 3, 4, BLOCK=16)
        lanes.join()

    return dict(fork_only=fork_only, fork_empties=fork_empties, main_empties=main_empties,
                fork_one_empty=fork_one_empty, launches=launches, fork_launches=fork_launches)


def timed_capture(body) -> tuple[float, float]:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(capture_stream()):
        graph.capture_begin()
        start = time.perf_counter()
        body()
        recorded = time.perf_counter()
        graph.capture_end()
    end = time.perf_counter()
    return recorded - start, end - recorded


def main() -> None:
    device = torch.device("cuda")
    for name, body in pieces(device).items():
        body()  # compile, streams
        torch.cuda.synchronize()
        eager = []
        for _ in range(3):
            start = time.perf_counter()
            body()
            eager.append(time.perf_counter() - start)
            torch.cuda.synchronize()
        captured = [timed_capture(body) for _ in range(3)]
        recording = [round(r * 1e3, 2) for r, _ in captured]
        instantiating = [round(i * 1e3, 2) for _, i in captured]
        print(f"{name:16s} eager {min(eager) * 1e3:7.2f} ms; captured: recording {recording} ms, instantiating "
              f"{instantiating}", flush=True)


if __name__ == "__main__":
    main()
