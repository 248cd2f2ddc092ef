"""Where a method's peak of live CUDA tensors lies in one generate call (twenty-second session): per method, one
warm generate, then one recorded with ``torch.cuda.memory._record_memory_history``; from the trace, the peak of the
bytes allocated during the call and the tensors live at that moment, grouped by the innermost kvbench or
transformers frame that allocated them.

    PYTHONPATH=/tmp/site:$PWD python3 results/gpu/2026-11-30/logs/s22_peak_probe.py --methods h2o,ems
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from kvbench.budget import Budget
from kvbench.engine import Engine
from scripts.profile_decode import configs, setup


def site(frames: list[dict]) -> str:
    """The innermost frame of kvbench or transformers (else the innermost) as file:line function."""
    for frame in frames:
        name = frame["filename"]
        if "/kvbench/" in name or "/transformers/" in name:
            return f"{name.split('/site-packages/')[-1].split('/main/')[-1]}:{frame['line']} {frame['name']}"
    return f"{frames[0]['filename']}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"


def peak_breakdown(trace: list[dict], top: int) -> list[str]:
    live, total, peak, peak_at = {}, 0, 0, -1
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            total += event["size"]
        elif event["action"] == "free_completed":
            total -= event["size"]
        if total > peak:
            peak, peak_at = total, i
    for event in trace[:peak_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    by_site = defaultdict(lambda: [0, 0])
    for event in live.values():
        by_site[site(event.get("frames", []))][0] += event["size"]
        by_site[site(event.get("frames", []))][1] += 1
    peak_event = trace[peak_at]
    lines = [f"  peak growth {peak / 2**20:.1f} MiB at event {peak_at} of {len(trace)} "
             f"(last allocation there: {peak_event['size'] / 2**20:.1f} MiB from {site(peak_event.get('frames', []))})"]
    for where, (size, count) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"    {size / 2**20:9.1f} MiB x{count:5d}  {where}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=8)
    args, _, lm, prompt = setup(parser, steps=0, top=25)
    for name in args.methods.split(","):
        _, method = configs(args.model, name)
        engine = Engine(lm.model, method, Budget("fraction", args.budget))
        engine.generate([prompt], args.new_tokens, set(), min_new_tokens=args.new_tokens)  # warm: compile, capture
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=500000)
        engine.generate([prompt], args.new_tokens, set(), min_new_tokens=args.new_tokens)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        print(f"== {name}: live before the call {base / 2**20:.1f} MiB, max_memory_allocated growth "
              f"{(torch.cuda.max_memory_allocated() - base) / 2**20:.1f} MiB", flush=True)
        print("\n".join(peak_breakdown(snapshot["device_traces"][0], args.top)), flush=True)
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
