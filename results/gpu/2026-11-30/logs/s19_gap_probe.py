"""What D2O's first decode step at 32k is made of on the host (nineteenth session). Call 1 of this session
(s18_post_pass_probe.py) found it host-bound: after the last compression is queued the host needs 18-28 ms more
before the recording starts, and the recording takes 61-72 ms (the full cache's: 37), all on an idle device.
Per method and warm call: host marks from the last compression queued (or the prompt pass queued) to the capture,
the allocator's segments (cudaMalloc calls) and allocations during the capture, and on the last call cProfile of
the gap and of the recording.

    PYTHONPATH=/tmp/site:$PWD python3 results/gpu/2026-11-30/logs/s19_gap_probe.py --methods full,d2o --length 32768
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from kvbench.budget import Budget
from kvbench import engine as engine_module
from kvbench.decode import DecodeBatch
from kvbench.engine import Engine, Session
from kvbench.graphs import DecodeGraph
from scripts.profile_decode import configs, setup

WRAPPED = [(Engine, "compress_kept_layers"), (Engine, "finish_row"), (Engine, "prefill_row"),
           (DecodeBatch, "_place"), (DecodeBatch, "_install"), (Session, "allocate"), (DecodeBatch, "_build_runner"),
           (DecodeGraph, "_capture")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--lanes", type=int, default=engine_module.LAYER_STREAMS, help="engine.LAYER_STREAMS")
    args, _, lm, prompt = setup(parser, steps=0, top=30)
    engine_module.LAYER_STREAMS = args.lanes
    marks: list[tuple[str, float]] = []
    profiles = {"gap": None, "recording": None}
    segments = {}
    gap_on: list[str] = []  # the gap's profile runs from the last compression (or the pass) on, once a call
    originals = {(owner, name): getattr(owner, name) for owner, name in WRAPPED}

    def wrap(owner, name):
        original = originals[(owner, name)]
        is_static = isinstance(owner.__dict__[name], classmethod)
        function = original.__func__ if is_static else original

        def wrapped(*a, **k):
            if name == "_capture":
                if profiles["gap"] is not None:
                    profiles["gap"].disable()
                stats = torch.cuda.memory_stats()
                if profiles["recording"] is not None:
                    profiles["recording"].enable()
            recording_marks = not any(n == "_capture >" for n, _ in marks)  # up to the first capture
            if recording_marks:
                marks.append((name + " <", time.perf_counter()))
            out = function(*a, **k)
            if recording_marks:
                marks.append((name + " >", time.perf_counter()))
            if name == "_capture":
                if profiles["recording"] is not None:
                    profiles["recording"].disable()
                after = torch.cuda.memory_stats()
                segments.update({key: after.get(key, 0) - stats.get(key, 0) for key in (
                    "segment.all.allocated", "allocation.all.allocated", "allocation.small_pool.allocated",
                    "allocation.large_pool.allocated")})
            if name in ("compress_kept_layers", "prefill_row") and profiles["gap"] is not None and not gap_on:
                profiles["gap"].enable()
                gap_on.append(name)
            return out
        setattr(owner, name, classmethod(wrapped) if is_static else wrapped)

    for owner, name in WRAPPED:
        wrap(owner, name)
    try:
        for method_name in args.methods.split(","):
            _, method = configs(args.model, method_name)
            engine = Engine(lm.model, method, Budget("fraction", args.budget))
            for call in range(args.calls):
                marks.clear(), segments.clear(), gap_on.clear()
                last = call == args.calls - 1
                profiles.update(gap=cProfile.Profile() if last else None,
                                recording=cProfile.Profile() if last else None)
                engine.generate([prompt], args.new_tokens, set(), min_new_tokens=args.new_tokens)
                torch.cuda.synchronize()
                t0 = next(t for n, t in marks if n == "prefill_row <")
                line = ", ".join(f"{n} {1e3 * (t - t0):.1f}" for n, t in marks if n != "prefill_row <")
                print(f"== {method_name} call {call}{' (profiled)' if last else ''}: host ms from prefill_row: {line}\n"
                      f"   during the capture: {segments}", flush=True)
            for window in ("gap", "recording"):
                for key in ("tottime", "cumtime"):
                    out = io.StringIO()
                    try:
                        pstats.Stats(profiles[window], stream=out).sort_stats(key).print_stats(args.top)
                    except TypeError:  # never enabled: no capture (a CPU rehearsal)
                        continue
                    print(f"-- {method_name} {window} by {key}")
                    print("\n".join(line for line in out.getvalue().splitlines() if line.strip()), flush=True)
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)


if __name__ == "__main__":
    main()
