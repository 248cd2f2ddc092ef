"""Where a decode step's time goes: the CUDA kernels of a few steps, eager, replayed as a CUDA graph, and
replayed with the decoder layers compiled (``engine.compile``), in one run.

    python scripts/profile_decode.py --model llama3.1-8b-shape-random --methods full --length 32768

Prints, per method and mode, the step time (host included), the GPU time and kernel count per step by
category (GEMM, attention, cache write/eviction, elementwise fused by compile, elementwise from aten, other),
the kernels that take most of it (count per step, microseconds per step), from torch.profiler's CUDA activity
(CUPTI also sees kernels inside graph replays), and the step's bytes-read bound (weights + the K+V bytes the
step reads, at the measured copy bandwidth) with the achieved fraction: bound / step time, and bound / GPU
time (the step without the host's share).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from torch.profiler import ProfilerActivity, profile

from kvbench import models
from kvbench.__main__ import CONF_DIR
from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.graphs import DecodeGraph
from kvbench.hardware import copy_bandwidth, parameter_bytes_read, tpot_bound_seconds


def kvbench_source() -> str:
    """Which ``kvbench`` this process imported: an A/B against an old copy (``gpu_session.sh ab``) prints it, since
    ``python -m`` puts the working directory, and so this checkout's ``kvbench``, first on ``sys.path``."""
    return f"kvbench from {Path(models.__file__).resolve().parent}"


def configs(model: str, method: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={model}", f"method={method}"])
    return cfg.model, instantiate(cfg.method)


def setup(parser: argparse.ArgumentParser, steps: int, top: int):
    """The profilers' shared arguments, the model they name and a random prompt of ``--length`` tokens."""
    parser.add_argument("--model", default="llama3.1-8b-shape-random")
    parser.add_argument("--methods", default="full,h2o")
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--top", type=int, default=top)
    args = parser.parse_args()
    print(kvbench_source())
    model_cfg, _ = configs(args.model, "full")
    lm = models.load(model_cfg)
    prompt = torch.randint(0, len(lm.tokenizer), (args.length,), generator=torch.Generator().manual_seed(0)).tolist()
    return args, model_cfg, lm, prompt


def stepper(session, graphs: bool):
    """A function running one greedy decode step of ``session`` (replayed as a CUDA graph with ``graphs``)."""
    token = session.logits.argmax(-1, keepdim=True)

    def body(static_shapes: bool) -> None:
        session.feed(token, "decode", static_shapes)
        token.copy_(session.logits.argmax(-1, keepdim=True))

    return DecodeGraph([session], body).step if graphs else lambda: body(False)


def steps(step, count: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(count):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / count


# kernel name fragments (lower case) per category; the first category that matches wins
CATEGORIES = (
    ("attention", ("_decode_partials", "_decode_combine", "_chunk_fwd", "_attention_fwd", "flash", "fmha",
                   "attention")),
    ("GEMM", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "splitk", "matmul")),
    ("cache write / eviction", ("_append", "_evict", "_move", "_select", "_merge")),
    ("EMS look-up-table expansion", ("_lut_expand", "_lut_fold")),
    ("elementwise, fused (compile)", ("triton_poi", "triton_red", "triton_per")),
    ("elementwise (aten)", ("elementwise", "vectorized", "reduce", "copy", "fill", "scatter", "gather", "index",
                            "cat", "softmax", "arange", "where")),
)
MODES = {"eager": (False, False), "graphs": (True, False), "graphs+compile": (True, True)}  # (graphs, compile)


def category(kernel: str) -> str:
    name = kernel.lower()
    return next((label for label, parts in CATEGORIES if any(part in name for part in parts)), "other")


def kernel_table(prof, count: int, top: int) -> tuple[list[str], float, float]:
    """Lines of the per-category and top-kernel tables; GPU milliseconds and kernels per step."""
    totals, calls = defaultdict(float), defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time_total
            calls[event.name] += 1
    gpu_ms, kernels = sum(totals.values()) / count / 1e3, sum(calls.values()) / count
    lines = [f"    GPU {gpu_ms:.2f} ms in {kernels:.0f} kernels per step"]
    by_category, count_by_category = defaultdict(float), defaultdict(int)
    for name, us in totals.items():
        by_category[category(name)] += us
        count_by_category[category(name)] += calls[name]
    for label, us in sorted(by_category.items(), key=lambda kv: -kv[1]):
        lines.append(f"    {us / count / 1e3:8.3f} ms  x{count_by_category[label] / count:6.0f}  {label}")
    lines.append("    top kernels:")
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"    {us / count:8.1f} us  x{calls[name] / count:5.1f}  {name[:110]}")
    return lines, gpu_ms, kernels


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _covered(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def timeline_lines(prof, count: int, gaps: int = 0) -> list[str]:
    """Where a step's wall time on the device goes, from the kernels' start and end: the step's span (first kernel
    start to last kernel end, averaged over ``count`` back-to-back steps), the time some kernel runs, the time none
    does (launch gaps), and the kernels' total time over the time they run (how many run at once: a decode
    step's per-layer side lanes, ``engine.LayerLanes``, overlap the pass). Streams are not told apart: inside a
    graph replay, CUPTI reports the driver's own streams for the branches. With ``gaps``, the ``gaps`` pairs of
    kernels (the last to end before a gap, the first to start after it) whose gaps add up to the most."""
    kernels = sorted((event.time_range.start, event.time_range.end, event.name)
                     for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)
    if not kernels or len(kernels) % count:
        return [f"    timeline: {len(kernels)} kernels do not split into {count} equal steps"]
    per_step = len(kernels) // count
    span = running = total = 0.0
    by_pair, pairs = defaultdict(float), defaultdict(int)
    for i in range(count):
        step = kernels[i * per_step:(i + 1) * per_step]
        span += max(end for _, end, _ in step) - step[0][0]
        running += _covered(_union([(start, end) for start, end, _ in step]))
        total += sum(end - start for start, end, _ in step)
        last_end, last_name = step[0][1], step[0][2]
        for start, end, name in step[1:]:
            if start > last_end:
                by_pair[(last_name, name)] += start - last_end
                pairs[(last_name, name)] += 1
            if end > last_end:
                last_end, last_name = end, name
    lines = [f"    timeline: span {span / count / 1e3:.3f} ms a step = kernels running {running / count / 1e3:.3f} + "
             f"none {(span - running) / count / 1e3:.3f}; {total / max(running, 1e-9):.2f} kernels at once on average"]
    for (before, after), us in sorted(by_pair.items(), key=lambda kv: -kv[1])[:gaps]:
        occurrences = pairs[before, after] / count
        lines.append(f"    gap {us / count:7.1f} us x{occurrences:5.1f}  {before[:50]}  ->  {after[:50]}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--gaps", type=int, default=0, help="print the kernel pairs around the most idle time")
    args, _, lm, prompt = setup(parser, steps=8, top=18)
    bandwidth = copy_bandwidth(lm.model.device)
    summary = []
    for name in args.methods.split(","):
        _, method = configs(args.model, name)
        for mode in args.modes.split(","):
            graphs, compiled = MODES[mode]
            engine = Engine(lm.model, method, Budget("fraction", args.budget), cuda_graphs=graphs, compile=compiled)
            session = engine.prefill([prompt], max_new_tokens=4 * args.steps + 8)
            step = stepper(session, graphs)
            steps(step, args.steps)  # warm-up: compile, capture
            seconds = steps(step, args.steps)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                steps(step, args.steps)
            kv_bytes = float(session.cache.row_bytes().sum())
            bound = tpot_bound_seconds(parameter_bytes_read(lm.model, 1), kv_bytes, bandwidth)
            lines, gpu_ms, kernels = kernel_table(prof, args.steps, args.top)
            lines += timeline_lines(prof, args.steps, args.gaps)
            print(f"== {name} {mode}: {seconds * 1e3:.2f} ms per step (host included); bytes-read bound "
                  f"{bound * 1e3:.2f} ms at {bandwidth / 1e12:.2f} TB/s: achieved fraction {bound / seconds:.2f}")
            print("\n".join(lines), flush=True)
            summary.append(f"  {name:>12} {mode:>15} {seconds * 1e3:8.2f} {gpu_ms:8.2f} {kernels:8.0f} "
                           f"{bound * 1e3:8.2f} {bound / seconds:9.2f} {bound * 1e3 / max(gpu_ms, 1e-9):9.2f}")
            del session, step
            torch.cuda.empty_cache()
    print(f"  {'method':>12} {'mode':>15} {'step ms':>8} {'GPU ms':>8} {'kernels':>8} {'bound ms':>8} {'fraction':>9} "
          f"{'of GPU':>9}")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
