"""Call 51: a decode step's per-layer observation and in-place eviction run in line (``engine.LAYER_STREAMS`` = 1,
the code before) against spread over 8 and 32 side streams, in one process: each set's replayed step profiled by
``scripts.profile_points`` (as ``split_scan_ab_call43.ab``), 1, 8, 32, 1, 8, 32 streams.

    PYTHONPATH=/tmp/site:. python3 results/gpu/2026-11-27/logs/layer_streams_ab_call51.py [METHODS]
"""
import argparse
import sys

from kvbench import engine as engine_module
from kvbench import models
from kvbench.hardware import copy_bandwidth
from scripts.bench_decode_loop import prompts, ragged
from scripts.profile_decode import configs
from scripts.profile_points import point_engines, profile_points

MODEL = "llama3.1-8b-shape-random"
SETS = [(65536, 1, method, "0.2") for method in ("cam", "d2o", "weightedkv", "tova", "h2o", "full")]
SETS += [(16000, 2, "cam", "0.2,0.35,0.5")]


def main(methods: list[str] | None) -> None:
    lm = models.load(configs(MODEL, "full")[0])
    bandwidth = copy_bandwidth(lm.model.device)
    lines = []
    for length, slots, method, budgets in SETS:
        if methods and method not in methods:
            continue
        batch = prompts(len(lm.tokenizer), ragged(length, slots))
        args = argparse.Namespace(model=MODEL, methods=method, budgets=budgets, length=length)
        for streams in (1, 8, 32, 1, 8, 32):
            engine_module.LAYER_STREAMS = streams
            engines = point_engines(args, lm.model)[method]
            lines.append(profile_points(engines, batch, 8, 6, bandwidth, f"{method} {length // 1000}k s{streams}"))
            del engines
    print("                   set  points  step ms   GPU ms  kernels  per pt+lyr bound ms  fraction")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else None)
