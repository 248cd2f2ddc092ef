"""Recording time of the first decode step against the number of side lanes (``engine.LAYER_STREAMS``), in one
process, interleaved (nineteenth session): call 3 of this session found D2O's 32k capture at 78 ms with 32 lanes
and 37 ms with one, but in different processes, whose host speed differs (the full cache's capture: 37-57 ms
between processes). Per method, rounds of one warm generate call at each lane count; the capture's host ms, the
first step's and the later steps' device ms (the generation's records).

    PYTHONPATH=/tmp/site:$PWD python3 results/gpu/2026-11-30/logs/s19_lanes_ab.py --methods full,d2o --lanes 32,1
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from kvbench import engine as engine_module
from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.graphs import DecodeGraph
from scripts.profile_decode import configs, setup


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--lanes", default="32,1")
    args, _, lm, prompt = setup(parser, steps=0, top=0)
    capture = DecodeGraph._capture
    seconds: list[float] = []

    def timed_capture(self, decisions):
        start = time.perf_counter()
        capture(self, decisions)
        seconds.append(time.perf_counter() - start)

    DecodeGraph._capture = timed_capture
    counts = [int(c) for c in args.lanes.split(",")]
    try:
        for name in args.methods.split(","):
            _, method = configs(args.model, name)
            engine = Engine(lm.model, method, Budget("fraction", args.budget))
            rows = defaultdict(list)
            for round_ in range(args.rounds + 1):
                for lanes in counts:
                    engine_module.LAYER_STREAMS = lanes
                    seconds.clear()
                    gen = engine.generate([prompt], args.new_tokens, set(), min_new_tokens=args.new_tokens)[0]
                    if round_ == 0:
                        continue  # warm-up: compiles, and the first capture of each lane count
                    rows[lanes].append((sum(seconds) * 1e3, gen.first_step_seconds * 1e3,
                                        gen.tpot_after_first_seconds * 1e3, gen.tpot_seconds * 1e3))
            for lanes in counts:
                print(f"{name} lanes {lanes:2d}: capture host ms, first step ms, after-first ms, tpot ms: "
                      + "; ".join(", ".join(f"{v:.2f}" for v in row) for row in rows[lanes]), flush=True)
    finally:
        DecodeGraph._capture = capture


if __name__ == "__main__":
    main()
