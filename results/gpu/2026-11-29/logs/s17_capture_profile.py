"""Where a decode batch's graph recording spends its host time (seventeenth session): D2O records its 32k step in
about 89 ms against the full cache's 59 (s17 call 4), on an idle device. Per method, one warm generate call with
``DecodeGraph._capture`` under cProfile: its recording time, then the functions by own time and by cumulative time.

    PYTHONPATH=/tmp/site:$PWD python3 results/gpu/2026-11-29/logs/s17_capture_profile.py --methods full,d2o

``--callees PATTERN`` also prints the callees of the functions matching PATTERN (the eighteenth session's call 4:
the lane fork's, ``"_observe_and_compress_in_pass|grad_mode.py:293|contextlib.py"``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.graphs import DecodeGraph
from scripts.profile_decode import configs, setup


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--callees", default="", help="print the callees of the functions matching this pattern")
    args, _, lm, prompt = setup(parser, steps=0, top=40)
    capture = DecodeGraph._capture
    state = {"profile": None, "seconds": []}

    def profiled_capture(self, decisions):
        start = time.perf_counter()
        if state["profile"] is not None:
            state["profile"].enable()
        capture(self, decisions)
        if state["profile"] is not None:
            state["profile"].disable()
        state["seconds"].append(time.perf_counter() - start)

    DecodeGraph._capture = profiled_capture
    for name in args.methods.split(","):
        _, method = configs(args.model, name)
        engine = Engine(lm.model, method, Budget("fraction", args.budget))
        for call in range(3):
            state["seconds"].clear()
            state["profile"] = cProfile.Profile() if call == 2 else None
            engine.generate([prompt], args.new_tokens, set(), min_new_tokens=args.new_tokens)
            print(f"== {name} call {call}: captures {[round(s * 1e3, 1) for s in state['seconds']]} ms", flush=True)
        for key in ("tottime", "cumtime"):
            out = io.StringIO()
            pstats.Stats(state["profile"], stream=out).sort_stats(key).print_stats(args.top)
            print("\n".join(line for line in out.getvalue().splitlines() if line.strip()), flush=True)
        if args.callees:
            out = io.StringIO()
            pstats.Stats(state["profile"], stream=out).sort_stats("cumtime").print_callees(args.callees)
            print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[-6000:], flush=True)
    DecodeGraph._capture = capture


if __name__ == "__main__":
    main()
