"""Does a decode step's recording cost less host time when every capture draws from one memory pool that outlives
the captures (a ``torch.cuda.MemPool``), so that a new graph's scratch comes from blocks an earlier graph freed
instead of fresh segments? Under capture, D2O's 320 ``torch.empty`` calls took 34 us each (s17 call 5), most of them
on the 32 side lanes, whose blocks a fresh pool cannot share across streams. ``--pool`` injects the pool into every
``CUDAGraph.capture_begin``; without it, the committed captures. Then the seventh session's first-step probe.

    PYTHONPATH=/tmp/site:$PWD python3 results/gpu/2026-11-29/logs/s18_pool_probe.py --pool -- \
        --methods full,d2o --length 32768 --calls 2
"""

from __future__ import annotations

import argparse
import runpy
import sys

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pool", action="store_true")
    args, rest = parser.parse_known_args()
    rest = [a for a in rest if a != "--"]
    if args.pool:
        pool = torch.cuda.MemPool()
        begin = torch.cuda.CUDAGraph.capture_begin

        def capture_begin(self, pool_id=None, *a, **k):
            return begin(self, pool_id if pool_id is not None else pool.id, *a, **k)

        torch.cuda.CUDAGraph.capture_begin = capture_begin
        print("captures draw from one MemPool", flush=True)
    sys.argv = ["s7_first_step_probe.py", *rest]
    runpy.run_path("results/gpu/2026-11-28/logs/s7_first_step_probe.py", run_name="__main__")


if __name__ == "__main__":
    main()
