"""The merging methods' fused decode steps as operations of the kernel benchmark (``kvbench.bench``).

One operation is one layer's ``evict_one``: ``--batch`` rows x ``--kv-heads`` heads of n slots each (n_keep =
n - 1, as at a decode step; positions in order, as after the prompt), head dim ``--head-dim``, random keys,
values and per-slot state. On CUDA, ``STEPS`` consecutive steps are captured as one CUDA graph and timed by
its replays, as the engine replays decode steps (``engine.cuda_graphs``): the time per step is the device's,
without Python's per-operation overhead, which the torch reference's ~40-300 small operations would
otherwise dominate. Every step removes one slot of every row, so rows shrink by a few dozen slots of thousands
over a measurement.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

STEPS = 8  # decode steps per timed CUDA graph
STEP_OPERATIONS = ("cam_step", "d2o_step", "weightedkv_step", "ems_step")


def _layer(n: int, states: int, args, device: torch.device, dtype: torch.dtype) -> dict[str, Tensor]:
    """A full layer of n slots per row: keys, values, raw keys, positions, lengths, stacked states, budgets."""
    g = torch.Generator(device="cpu").manual_seed(n)
    B, H, D = args.batch, args.kv_heads, args.head_dim
    return dict(keys=torch.randn(B, H, n, D, generator=g).to(device, dtype),
                values=torch.randn(B, H, n, D, generator=g).to(device, dtype),
                raw_keys=torch.randn(B, H, n, D, generator=g).to(device, dtype),
                positions=torch.arange(n, device=device).expand(B, H, n).contiguous(),
                lengths=torch.full((B, H), n, device=device),
                state=torch.rand(states, B, H, n, generator=g).to(device),
                n_keep=torch.full((B,), n - 1, device=device))


def _look_up_table(layer: dict[str, Tensor], n: int) -> tuple[Tensor, Tensor, Tensor]:
    """EMS's table at gamma = 4 (3 (n - 1) entries), half full of members centred on the row's slots."""
    B, H = layer["lengths"].shape
    E = 3 * (n - 1)
    entry = torch.arange(E, device=layer["keys"].device).expand(B, H, E)
    used = entry < E // 2
    return (torch.where(used, n + entry, -1), torch.where(used, entry % n, -1),
            torch.where(used, 1.0, -1.0).to(torch.float32))


def _steps(backend: str, step: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """A call that runs ``step`` with ``backend``'s kernels: on CUDA the replay of a graph of ``STEPS`` steps
    (``call.steps`` says how many the time covers), elsewhere one eager step."""
    from kvbench.kernels.dispatch import use_backend

    def one() -> None:
        with use_backend(backend):
            step()

    if device.type != "cuda":
        one.steps = 1
        return one
    one()  # compiles the kernels and warms the allocator outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        one()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(STEPS):
            one()

    def replay() -> None:
        graph.replay()

    replay.steps = STEPS
    return replay


def decode_step_operations(args, device: torch.device, dtype: torch.dtype) -> dict[str, tuple[str, Callable]]:
    """name -> (expected complexity, make(n, backend) -> a call to time), as ``bench.operations``."""
    from kvbench.kernels.cam_step import cam_step, draw_key
    from kvbench.kernels.d2o_step import d2o_step
    from kvbench.kernels.ems_step import ems_step
    from kvbench.kernels.weightedkv_step import weightedkv_step

    def cam(n, backend):  # CaM's defaults: StreamingLLM eviction, 4 sinks, 16 targets, sampled merges
        s = _layer(n, 1, args, device, dtype)
        return _steps(backend, lambda: cam_step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"],
                                                s["state"][0], s["n_keep"], 4, None, 16, draw_key(0, 0)), device)

    def d2o(n, backend):  # D2O's defaults: 3:1 heavy:recent, 4 sinks, per-head threshold, weighted merge
        s = _layer(n, 2, args, device, dtype)
        s["state"][1] = 0.5
        return _steps(backend, lambda: d2o_step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"],
                                                s["state"][0], s["state"][1], s["n_keep"], 3, 1, 4, 0.7, False,
                                                True), device)

    def weightedkv(n, backend):  # WeightedKV's defaults: 4 sinks, recent window n / 2 - 4
        s = _layer(n, 2, args, device, dtype)
        s["state"][1] = 1.0 + s["state"][1].round()
        return _steps(backend, lambda: weightedkv_step(s["keys"], s["values"], s["positions"], s["lengths"],
                                                       s["state"], s["state"][0], s["state"][1], s["n_keep"], 4,
                                                       None), device)

    def ems(n, backend):  # EMS's defaults: L_win 32, tau 0.6 (here 0: every step merges), gamma 4, lut
        s = _layer(n, 5, args, device, dtype)
        lut = _look_up_table(s, n)
        return _steps(backend, lambda: ems_step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"],
                                                s["raw_keys"], tuple(s["state"][:3]),
                                                (s["state"][3], s["state"][4], None), lut, s["n_keep"], 32, 0.0,
                                                4.0, "key_value", False), device)

    return dict(zip(STEP_OPERATIONS, (("n", cam), ("n", d2o), ("n", weightedkv), ("n", ems))))
