"""Prompt compression of one layer at a real shape, beside that layer's own work: what each method adds to TTFT.

    python scripts/bench_prefill.py                     # CUDA: Llama-3.1-8B shape, 16384 and 32768 tokens, bf16
    python scripts/bench_prefill.py --device cpu --lengths 2048 --heads 9 --kv-heads 3 --head-dim 64

Synthetic layer (B = 1): raw keys drift along the sequence (each is 0.8 of the previous one plus noise, so that
neighbours are similar and the merging methods merge), RoPE'd like Llama's; random queries and values. Rows,
each the median of ``--repeats`` timed calls after a warm-up:
- ``layer``: the decoder layer the full cache runs, i.e. causal sdpa plus the layer's seven projections
  (``--hidden``, ``--intermediate``); ``attention``: the sdpa alone.
- per method, ``stats``: the prompt pass's attention with the statistics the method declares, through the
  engine's own path (``attention._prompt_attention``), minus the plain sdpa; ``compress``: its prefill
  ``compress`` of the layer at ``--budget`` (the statistics it gets are real: computed from the layer);
  ``host``: the part of it the host spends issuing work (close to ``compress``: host-bound, launches and
  Python; well below: device-bound); ``peak MiB``: memory ``compress`` allocates above its inputs, beside
  the decoder layer's own (CUDA only; a compress peak under the layer's leaves the run's peak alone);
  ``TTFT x``: the predicted TTFT ratio to the full cache, (layer + stats + compress) / layer. D2O's
  ``layer_budgets`` for ``--layers`` layers is added to its compress, divided by the layer count.
``--profile`` adds each method's five costliest device kernels (torch profiler).
Targets (issue 21; the lead's brief): TTFT x <= 1.15 (1.25) for every method; compress a few ms per layer;
compress peak below the layer's.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvbench.attention import _prompt_attention  # noqa: E402
from kvbench.bench import time_call  # noqa: E402
from kvbench.cache import PassPlan  # noqa: E402
from kvbench.kv import AttentionStats, LayerKV  # noqa: E402

METHODS = "streamingllm,h2o,snapkv,pyramidkv,tova,cam,d2o,kvmerger,ems,weightedkv,chelsea"
CONF = Path(__file__).resolve().parents[1] / "conf" / "method"


def build_method(name: str):
    """The method as ``conf/method/<name>.yaml`` configures it (seed 0, no Chelsea outlier heads)."""
    from omegaconf import OmegaConf

    from kvbench.checks import instantiate_config

    root = OmegaConf.create({"seed": 0, "chelsea_outlier_heads": None})
    root.method = OmegaConf.load(CONF / f"{name}.yaml")
    return instantiate_config(root.method)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 500000.0) -> torch.Tensor:
    """Llama's rotate_half RoPE of x (B, H, T, D) at positions (T,)."""
    half = x.shape[-1] // 2
    freq = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = positions.float().view(-1, 1) * freq
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def synthetic_layer(n: int, args, device, dtype) -> dict:
    """Queries (1, H_q, n, D), raw keys and RoPE'd keys, values (1, H_kv, n, D) and positions (1, n)."""
    g = torch.Generator(device="cpu").manual_seed(n)
    Hq, Hkv, D = args.heads, args.kv_heads, args.head_dim
    noise = torch.randn(1, Hkv, n, D, generator=g)
    raw = torch.empty_like(noise)
    raw[:, :, 0] = noise[:, :, 0]
    for t in range(1, n):  # an AR(1) walk: adjacent keys correlate at 0.8
        raw[:, :, t] = 0.8 * raw[:, :, t - 1] + 0.6 * noise[:, :, t]
    raw = raw.to(device, dtype)
    positions = torch.arange(n, device=device)
    return {"query": torch.randn(1, Hq, n, D, generator=g).to(device, dtype), "raw_keys": raw,
            "keys": rope(raw, positions), "values": torch.randn(1, Hkv, n, D, generator=g).to(device, dtype),
            "positions": positions.view(1, n)}


def sdpa(layer: dict, scaling: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(layer["query"], layer["keys"], layer["values"], is_causal=True,
                                          scale=scaling, enable_gqa=True)


def decoder_layer(layer: dict, weights: dict, scaling: float) -> torch.Tensor:
    """The full cache's layer: q/k/v projections, causal sdpa, output projection and the gated MLP."""
    B, Hq, n, D = layer["query"].shape
    hidden = weights["x"]
    q, k, v = (F.linear(hidden, weights[name]) for name in ("q", "k", "v"))
    out = sdpa({"query": q.view(B, n, Hq, D).transpose(1, 2), "keys": k.view(B, n, -1, D).transpose(1, 2),
                "values": v.view(B, n, -1, D).transpose(1, 2)}, scaling)
    hidden = hidden + F.linear(out.transpose(1, 2).reshape(B, n, Hq * D), weights["o"])
    gate = F.silu(F.linear(hidden, weights["gate"])) * F.linear(hidden, weights["up"])
    return hidden + F.linear(gate, weights["down"])


def layer_weights(n: int, args, device, dtype) -> dict:
    D, h, m = args.head_dim, args.hidden, args.intermediate
    shapes = {"x": (1, n, h), "q": (args.heads * D, h), "k": (args.kv_heads * D, h), "v": (args.kv_heads * D, h),
              "o": (h, args.heads * D), "gate": (m, h), "up": (m, h), "down": (h, m)}
    return {name: torch.randn(shape, device=device, dtype=dtype) * shape[-1] ** -0.5 for name, shape in shapes.items()}


def prompt_stats(method, layer: dict, scaling: float):
    """The prompt pass's attention with the method's statistics, as the engine runs it: (output, stats dict)."""
    def base(module, query, key, value, mask, scaling=None, **kwargs):
        return sdpa({"query": query, "keys": key, "values": value}, scaling).transpose(1, 2), None

    n = layer["query"].shape[2]
    plan = PassPlan(query_positions=layer["positions"], num_queries=torch.tensor([n], device=layer["keys"].device),
                    wanted=method.needs, window=method.window)
    output, (stats, *_) = _prompt_attention(base, None, layer["query"], layer["keys"], layer["values"], scaling, plan,
                                            {})  # the plan's own statistics (it shares no pass: no further sets)
    return output, stats


def method_inputs(method, layer: dict, scaling: float) -> AttentionStats:
    n = layer["query"].shape[2]
    _, stats = prompt_stats(method, layer, scaling)
    raw = layer["raw_keys"] if "raw_keys" in method.needs else None
    return AttentionStats(num_queries=torch.tensor([n], device=layer["keys"].device), raw_keys=raw, **stats)


def fresh_kv(layer: dict) -> LayerKV:
    """A just-prefilled layer sharing the synthetic tensors (``compress`` never writes its input's storage)."""
    return LayerKV.from_dense(layer["keys"], layer["values"])


def host_ms(call, device, repeats: int) -> float:
    """Median milliseconds the host spends in ``call`` before the device catches up (no final sync)."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def top_kernels(call, device, count: int = 5) -> str:
    """The ``count`` device kernels of ``call`` with the most device time, one line each."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize(device)
    launches = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    rows = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)[:count]
    lines = [f"    {e.self_device_time_total / 1e3:8.3f} ms  x{e.count:<4d} {e.key[:90]}" for e in rows]
    return "\n".join([f"    {launches} device kernels in all"] + lines)


def peak_mib(call, device) -> float:
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    call()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def bench_length(n: int, args, device, dtype) -> list[dict]:
    layer = synthetic_layer(n, args, device, dtype)
    scaling = args.head_dim ** -0.5
    weights = layer_weights(n, args, device, dtype)
    attention_s = time_call(lambda: sdpa(layer, scaling), args.repeats, device)
    layer_s = time_call(lambda: decoder_layer(layer, weights, scaling), args.repeats, device)
    layer_peak = peak_mib(lambda: decoder_layer(layer, weights, scaling), device)
    del weights
    rows = [{"length": n, "row": "layer", "ms": layer_s * 1e3, "peak_mib": layer_peak},
            {"length": n, "row": "attention", "ms": attention_s * 1e3, "peak_mib": float("nan")}]
    print(f"{n:6d} layer {layer_s * 1e3:8.2f} ms (peak {layer_peak:.0f} MiB)   attention (sdpa causal) "
          f"{attention_s * 1e3:8.2f} ms", flush=True)
    n_keep = torch.tensor([max(1, math.floor(args.budget * n + 0.5))], device=device)
    for name in args.methods:
        method = build_method(name)
        stats = method_inputs(method, layer, scaling)
        stats_s = time_call(lambda: prompt_stats(method, layer, scaling), args.repeats, device) - attention_s
        def compress():
            return method.compress(0, fresh_kv(layer), stats, n_keep, "prefill")

        compress_s = time_call(compress, args.repeats, device)
        host = host_ms(compress, device, args.repeats)
        if method.budget_needs:  # once per model, before any layer compresses: its per-layer share
            compress_s += time_call(lambda: method.layer_budgets(n_keep, args.layers, [stats] * args.layers, 32),
                                    args.repeats, device) / args.layers
        peak = peak_mib(compress, device)
        ttft = (layer_s + max(stats_s, 0.0) + compress_s) / layer_s
        rows.append({"length": n, "row": name, "stats_ms": stats_s * 1e3, "compress_ms": compress_s * 1e3,
                     "host_ms": host, "peak_mib": peak, "ttft_ratio": ttft,
                     "compress_per_attention": compress_s / attention_s})
        print(f"{n:6d} {name:13s} stats {stats_s * 1e3:8.2f} ms  compress {compress_s * 1e3:8.2f} ms "
              f"(host {host:7.2f}, {compress_s / attention_s:5.2f}x attention)  peak {peak:8.1f} MiB  "
              f"TTFT x {ttft:5.2f}", flush=True)
        if args.profile and device.type == "cuda":
            print(top_kernels(compress, device), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| length | method | stats ms | compress ms | host ms | compress / attention | peak MiB | "
             "TTFT x (target <= 1.15) |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["row"] in ("layer", "attention"):
            lines.append(f"| {r['length']} | {r['row']} | | {r['ms']:.2f} | | | {r['peak_mib']:.0f} | |")
        else:
            lines.append(f"| {r['length']} | {r['row']} | {r['stats_ms']:.2f} | {r['compress_ms']:.2f} | "
                         f"{r['host_ms']:.2f} | {r['compress_per_attention']:.2f} | {r['peak_mib']:.0f} | "
                         f"{r['ttft_ratio']:.2f} |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--lengths", default="16384,32768")
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="print each method's costliest device kernels")
    args = parser.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.methods = args.methods.split(",")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows = []
    for n in args.lengths:
        rows += bench_length(n, args, device, dtype)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
