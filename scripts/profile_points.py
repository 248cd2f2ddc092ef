"""Where a fused sweep's decode step goes (issue 22): the CUDA kernels of a replayed step whose rows belong to
many points (methods x budgets, ``--slots`` rows each, ragged prompts around ``--length``), as
``kvbench.sweep`` decodes them together, then each method's points alone.

    python -m scripts.profile_points --methods full,streamingllm,h2o,snapkv,pyramidkv,tova,cam,d2o,kvmerger,ems,weightedkv,chelsea \
        --budgets 0.2,0.35,0.5 --length 16000 --slots 2

Prints per set of points: replayed step wall, GPU time and kernels per step (``profile_decode.kernel_table``:
by category and the top kernels), kernels per point and layer, and the step's bytes-read bound (weights once,
every row's K+V bytes) with the achieved fraction. On a CPU (a smoke run on the tiny model) it counts the
outermost aten operators of a step instead of kernels.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from kvbench import models
from kvbench.budget import Budget
from kvbench.decode import DecodeBatch, DecodeRequest
from kvbench.engine import Engine, _sync
from kvbench.hardware import copy_bandwidth, parameter_bytes_read, tpot_bound_seconds
from kvbench.shared_prefill import prefill_points
from scripts.bench_decode_loop import prompts, ragged
from scripts.profile_decode import configs, kernel_table, kvbench_source, timeline_lines


def operator_table(prof, count: int, top: int) -> tuple[list[str], float, float]:
    """On a CPU, the outermost aten operators per step (what a CUDA step launches kernels for), the most
    frequent first: (lines, 0, operators per step)."""
    calls = Counter(event.name for event in prof.events()
                    if event.name.startswith("aten::") and not _inside_aten(event))
    lines = [f"    {sum(calls.values()) / count:.0f} aten operators per step; the most frequent:"]
    lines += [f"    x{n / count:6.0f}  {name}" for name, n in calls.most_common(top)]
    return lines, 0.0, sum(calls.values()) / count


def _inside_aten(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def profile_points(engines: list[Engine], batch: list[list[int]], steps: int, top: int, bandwidth: float,
                   label: str) -> str:
    """Profile the replayed decode step of ``engines`` (one point each), every prompt of ``batch`` in a slot of
    every point; returns the summary line."""
    new_tokens = 4 * steps + 16
    decode = DecodeBatch(engines, len(batch))
    for prompt in batch:
        for point, row in enumerate(prefill_points(engines, prompt, new_tokens, [])):
            if isinstance(row, Exception):
                raise row
            decode.admit(point, row, DecodeRequest(new_tokens))
        decode.place()
    for _ in range(steps):  # placement, warm-up, capture, replays
        decode.step()
    _sync(engines[0].device)
    start = time.perf_counter()
    for _ in range(steps):
        decode.step()
    _sync(engines[0].device)
    seconds = (time.perf_counter() - start) / steps
    cuda = engines[0].device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            decode.step()
        _sync(engines[0].device)
    kv_bytes = float(decode.row_bytes.sum())
    rows = len(engines) * len(batch)
    bound = tpot_bound_seconds(parameter_bytes_read(engines[0].model, rows), kv_bytes, bandwidth)
    replays = decode.replays
    decode.close()
    lines, gpu_ms, kernels = kernel_table(prof, steps, top) if cuda else operator_table(prof, steps, top)
    if cuda:
        lines += timeline_lines(prof, steps)
    layers = engines[0].model.config.num_hidden_layers
    print(f"== {label}: {len(engines)} points x {len(batch)} rows, {replays} replays: {seconds * 1e3:.2f} ms per "
          f"step; bytes-read bound {bound * 1e3:.2f} ms (fraction {bound / seconds:.2f}); "
          f"{kernels / (len(engines) * layers):.1f} kernels per point and layer")
    print("\n".join(lines), flush=True)
    return (f"  {label:>14} {len(engines):>6} {seconds * 1e3:8.2f} {gpu_ms:8.2f} {kernels:8.0f} "
            f"{kernels / (len(engines) * layers):10.1f} {bound * 1e3:8.2f} {bound / seconds:9.2f}")


def point_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments naming a set of points and their prompts: --model, --methods, --budgets (every method at
    every budget), --length."""
    parser.add_argument("--model", default="llama3.1-8b-shape-random")
    parser.add_argument("--methods", default="full,h2o")
    parser.add_argument("--budgets", default="0.2,0.35,0.5")
    parser.add_argument("--length", type=int, default=16000)


def point_engines(args: argparse.Namespace, model) -> dict[str, list[Engine]]:
    """Per method of ``args.methods``, its engines at ``args.budgets`` over ``model``."""
    budgets = [float(b) for b in args.budgets.split(",")]
    return {name: [Engine(model, configs(args.model, name)[1], Budget("fraction", b)) for b in budgets]
            for name in args.methods.split(",")}


def main() -> None:
    parser = argparse.ArgumentParser()
    point_arguments(parser)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--alone", action="store_true", help="also each method's points without the others")
    parser.add_argument("--alone-only", action="store_true", help="each method's points alone, not all together")
    args = parser.parse_args()
    print(kvbench_source())
    model_cfg, _ = configs(args.model, "full")
    lm = models.load(model_cfg)
    bandwidth = copy_bandwidth(lm.model.device)
    batch = prompts(len(lm.tokenizer), ragged(args.length, args.slots))
    engines = point_engines(args, lm.model)
    summary = [] if args.alone_only else [
        profile_points([e for es in engines.values() for e in es], batch, args.steps, args.top, bandwidth, "all")]
    if args.alone or args.alone_only:
        for name, es in engines.items():
            summary.append(profile_points(es, batch, args.steps, args.top, bandwidth, name))
            if lm.model.device.type == "cuda":  # the previous set's storage, cached by the allocator
                torch.cuda.empty_cache()
    print(f"  {'points':>14} {'count':>6} {'step ms':>8} {'GPU ms':>8} {'kernels':>8} {'per pt+lyr':>10} "
          f"{'bound ms':>8} {'fraction':>9}")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
