"""Whether a fused sweep's shared prompt pass waits for the device or for the host (issue 22): one prompt's
``prefill_points`` for many points (methods x budgets) in one process: twice to compile and warm up, ``--repeats``
times timed (with ``--suffix``, also with every row's suffix fed by a pass of its own), then once under
torch.profiler.

    python -m scripts.profile_shared_pass --methods full,streamingllm,h2o,snapkv,pyramidkv,tova,cam,d2o,kvmerger,ems,weightedkv,chelsea \
        --budgets 0.2,0.35,0.5 --length 16000

Prints the pass's wall, the device's busy time (the union of its kernels' intervals) and idle share, kernels and
their summed time, the host's time in calls that wait for the device (synchronisations, copies to the host), and
the kernels (``profile_decode.kernel_table``: by category, then the top ones) and host operators that take most
of it. ``--sync-sites`` instead lists where one pass waits for the device: each synchronising call that torch's
sync debug mode reports, by the innermost kvbench line that made it (every thread: the pass's and the worker's).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kvbench import models
from kvbench.engine import Engine, Session, _sync
from kvbench.shared_prefill import prefill_points
from scripts.bench_decode_loop import prompts
from scripts.profile_decode import configs, kernel_table
from scripts.profile_points import point_arguments, point_engines

WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync", "cudaMemcpy")


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals (microseconds in, seconds out)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e6


def timed(engines: list[Engine], prompt: list[int], suffix: list[int], repeats: int) -> str:
    """The shared pass's wall, best and mean of ``repeats``."""
    walls = []
    for _ in range(repeats):
        _sync(engines[0].device)
        start = time.perf_counter()
        rows = prefill_points(engines, prompt, 30, suffix)
        _sync(engines[0].device)
        walls.append(time.perf_counter() - start)
        del rows
    return f"wall {min(walls):.3f} s (best of {repeats}; mean {sum(walls) / len(walls):.3f} s)"


def sync_sites(engines: list[Engine], prompt: list[int], suffix: list[int], top: int) -> str:
    """One pass under torch's sync debug mode: its synchronising calls counted by the innermost kvbench frame
    that made them and that frame's kvbench caller (file:line function)."""
    sites: Counter[str] = Counter()
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        frames = [f"{f.filename.split('/kvbench/')[-1]}:{f.lineno} {f.name}"
                  for f in traceback.extract_stack()[:-1] if "/kvbench/" in f.filename]
        sites[" <- ".join(reversed(frames[-2:])) if frames else f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():  # restores the filters and the hook on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            rows = prefill_points(engines, prompt, 30, suffix)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        del rows
    lines = [f"== {sum(sites.values())} synchronising calls in one pass of {len(engines)} points, by site:"]
    lines += [f"  {n:6d}  {site}" for site, n in sites.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    point_arguments(parser)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--suffix", type=int, default=0, help="a suffix of this many tokens (query-agnostic prompts): "
                        "the pass is also timed with every row's suffix fed by a pass of its own")
    parser.add_argument("--sync-sites", action="store_true", help="list where a pass waits for the device, then stop")
    args = parser.parse_args()
    if args.sync_sites and not torch.cuda.is_available():
        parser.error("--sync-sites counts waits for a CUDA device; none is available")
    model_cfg, _ = configs(args.model, "full")
    lm = models.load(model_cfg)
    device = lm.model.device
    prompt, suffix = prompts(len(lm.tokenizer), [args.length, args.suffix])
    engines = [engine for name, per_budget in point_engines(args, lm.model).items()
               for engine in (per_budget[:1] if name == "full" else per_budget)]  # a sweep runs the full cache once
    for _ in range(2):  # compile, warm up
        rows = prefill_points(engines, prompt, 30, suffix)
        del rows
    print(f"== unprofiled: {timed(engines, prompt, suffix, args.repeats)}", flush=True)
    if args.sync_sites:
        print(sync_sites(engines, prompt, suffix, args.top))
        return
    if suffix:
        together = Session.feed_together
        Session.feed_together = staticmethod(lambda sessions, tokens, phase, *rest: [
            session.feed(tokens[:1], phase) for session in sessions])
        try:
            print(f"== unprofiled, every row's suffix by a pass of its own: "
                  f"{timed(engines, prompt, suffix, args.repeats)}", flush=True)
        finally:
            Session.feed_together = together
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        rows = prefill_points(engines, prompt, 30, suffix)
        _sync(device)
        wall = time.perf_counter() - start
    errors = [row for row in rows if isinstance(row, Exception)]
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    busy = busy_seconds([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    waits = defaultdict(float)
    for e in runtime:
        if e["name"] in WAITS:
            waits[e["name"]] += e["dur"] / 1e6
    launches = Counter(e["name"] for e in runtime)
    threads = defaultdict(list)  # host thread -> its operators' intervals (the pass's, the worker's)
    for e in events:
        if e.get("cat") in ("cpu_op", "cuda_runtime"):
            threads[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    print(f"== {len(engines)} points, {args.length} tokens ({len(errors)} errors): wall {wall:.3f} s, device busy "
          f"{busy:.3f} s (idle {1 - busy / wall:.0%}), {len(kernels)} kernels summing "
          f"{sum(e['dur'] for e in kernels) / 1e6:.3f} s")
    print("   host calls that wait for the device: " + ", ".join(f"{name} {s:.3f} s" for name, s in waits.items()))
    print("   host threads busy: " + ", ".join(f"thread {tid}: {busy_seconds(spans):.3f} s"
                                               for tid, spans in threads.items()))
    print("   runtime calls: " + ", ".join(f"{name} x{n}" for name, n in launches.most_common(8)))
    if device.type == "cuda":  # the pass's kernels by category and the top ones (microseconds in the pass)
        print("\n".join(kernel_table(prof, 1, args.top)[0]))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
