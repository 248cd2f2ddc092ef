"""Where a timed generate's first decode step waits (seventh session): per call, when prefill_row returned on the
host against its prefill time, when the capture recorded, the decode batch's step kinds, TTFT and TPOT; then one
call under torch.cuda.set_sync_debug_mode("warn"), its synchronising call sites (kvbench frames) counted.

    python3 results/gpu/2026-11-28/logs/s7_first_step_probe.py --methods full,ems --length 32768
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import pstats
import time
import traceback
import warnings
from collections import Counter

import torch

from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.graphs import DecodeGraph
from scripts.profile_decode import configs, setup


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    args, _, lm, prompt = setup(parser, steps=0, top=0)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("kvbench").addHandler(handler)
    logging.getLogger("kvbench").setLevel(logging.INFO)
    prefill_row, capture = Engine.prefill_row, DecodeGraph._capture
    marks = {}

    profiles = {}

    def timed_prefill(self, *a, **k):
        profiler = profiles.get("now")
        marks["prefill_start"] = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        row = prefill_row(self, *a, **k)
        if profiler is not None:
            profiler.disable()
        marks["prefill_returned"] = time.perf_counter()
        return row

    def timed_capture(self, decisions):
        marks["capture_start"] = time.perf_counter()
        capture(self, decisions)
        marks["capture_end"] = time.perf_counter()

    Engine.prefill_row, DecodeGraph._capture = timed_prefill, timed_capture
    for name in args.methods.split(","):
        _, method = configs(args.model, name)
        engine = Engine(lm.model, method, Budget("fraction", args.budget))
        for call in range(args.calls + 1):
            marks.clear()
            lines.clear()
            sites = Counter()
            debug = call == args.calls and torch.cuda.is_available()
            profiles["now"] = cProfile.Profile() if call == args.calls - 1 else None
            if debug:
                torch.cuda.set_sync_debug_mode("warn")
            def show(message, category, filename, lineno, file=None, line=None):
                frames = [f for f in traceback.extract_stack()[:-1] if "/kvbench/" in f.filename]
                sites[" <- ".join(f"{f.filename.split('/kvbench/')[-1]}:{f.lineno}" for f in frames[::-1][:4])] += 1

            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                gen = engine.generate([prompt], args.new_tokens, set(), min_new_tokens=args.new_tokens)[0]
            if debug:
                torch.cuda.set_sync_debug_mode("default")
            start = marks.get("prefill_start", 0.0)
            rel = {k: round(v - start, 4) for k, v in marks.items()}
            print(f"{name} call {call}{' (sync debug)' if debug else ''}: ttft {gen.prefill_seconds:.4f} "
                  f"tpot {gen.tpot_seconds * 1e3:.3f} ms decode {gen.decode_seconds:.4f} host marks {rel}", flush=True)
            for line in lines:
                if "decode batch" in line:
                    print("   ", line, flush=True)
            if profiles["now"] is not None:  # where the host spent prefill_row: a wait shows as one call's own time
                out = io.StringIO()
                pstats.Stats(profiles["now"], stream=out).sort_stats("tottime").print_stats(8)
                print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[-2500:], flush=True)
            for site, n in sites.most_common(10):
                print(f"    sync x{n}: {site}", flush=True)
    Engine.prefill_row, DecodeGraph._capture = prefill_row, capture


if __name__ == "__main__":
    main()
