"""Where D2O's first decode step at 32k waits (eighteenth session, for the next one): the host and the device on one
timeline from the prompt pass's budget read to the first replayed step. At 64k D2O's first step equals its others
(6.0 ms, s18 call 6), at 32k it is 60-100 ms (the graph's recording on an idle device): the guess is that the host
queues the 32 prompt compressions no faster than the device runs them, so that nothing is left queued when the
recording starts. Printed per call, in ms from the prefill's start (the device idle then, so an event recorded at
that moment and the host clock start together):
  host:   the budget read returns; the compressions are queued (each layer's host ms); the recording starts and ends;
  device: the pass's tail is done (an event recorded as the budget read returns); the compressions are done (an
          event recorded as their queueing returns); the first step is done.
The recording hides under the compressions where the device finishes them after the host starts recording.

    PYTHONPATH=/tmp/site:$PWD python3 results/gpu/2026-11-29/logs/s18_post_pass_probe.py --methods d2o \
        --length 32768 --calls 2
"""

from __future__ import annotations

import argparse
import time

import torch

from kvbench.budget import Budget
from kvbench.engine import BudgetStatistics, Engine
from kvbench.graphs import DecodeGraph
from scripts.profile_decode import configs, setup


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=16)
    args, _, lm, prompt = setup(parser, steps=0, top=0)
    host, events, layers = {}, {}, []
    originals = (Engine.prefill_row, BudgetStatistics.budget_stats, Engine.compress_kept_layers,
                 Engine.compress_prompt_layer, DecodeGraph._capture)
    prefill_row, budget_stats, compress_kept_layers, compress_prompt_layer, capture = originals

    def mark(name: str) -> None:
        host[name] = time.perf_counter()
        events[name] = torch.cuda.Event(enable_timing=True)
        events[name].record()

    def timed_prefill(self, *a, **k):
        torch.cuda.synchronize()
        mark("start")
        return prefill_row(self, *a, **k)

    def timed_budget(self, *a, **k):
        out = budget_stats(self, *a, **k)
        mark("budget read")
        return out

    def timed_kept(self, *a, **k):
        compress_kept_layers(self, *a, **k)
        mark("compressions queued")

    def timed_layer(self, *a, **k):
        start = time.perf_counter()
        compress_prompt_layer(self, *a, **k)
        layers.append(time.perf_counter() - start)

    def timed_capture(self, decisions):
        host["recording starts"] = time.perf_counter()
        capture(self, decisions)
        mark("first step replayed")

    Engine.prefill_row, BudgetStatistics.budget_stats = timed_prefill, timed_budget
    Engine.compress_kept_layers, Engine.compress_prompt_layer, DecodeGraph._capture = timed_kept, timed_layer, \
        timed_capture
    try:
        for name in args.methods.split(","):
            _, method = configs(args.model, name)
            engine = Engine(lm.model, method, Budget("fraction", args.budget))
            for call in range(args.calls + 1):
                host.clear(), events.clear(), layers.clear()
                gen = engine.generate([prompt], args.new_tokens, set(), min_new_tokens=args.new_tokens)[0]
                torch.cuda.synchronize()
                t0, e0 = host["start"], events["start"]
                on_host = {k: round((v - t0) * 1e3, 1) for k, v in host.items() if k != "start"}
                on_device = {k: round(e0.elapsed_time(e), 1) for k, e in events.items() if k != "start"}
                print(f"{name} call {call}: ttft {gen.prefill_seconds * 1e3:.1f} ms, tpot {gen.tpot_seconds * 1e3:.3f} "
                      f"ms\n    host ms:   {on_host}\n    device ms: {on_device}\n    host ms per layer's "
                      f"compression queued: {[round(s * 1e3, 2) for s in layers]}", flush=True)
    finally:
        (Engine.prefill_row, BudgetStatistics.budget_stats, Engine.compress_kept_layers, Engine.compress_prompt_layer,
         DecodeGraph._capture) = originals


if __name__ == "__main__":
    main()
