"""Where a decode batch's graph capture spends its host time: cProfile of the captures of a few ``generate`` calls.

Each method's engine decodes ``--batch`` random prompts of ``--length`` tokens at batch ``--batch`` (one decode
batch, its graph captured at its first replayable step), ``--calls`` times; the first call compiles, the
later ones are profiled, and only while ``DecodeGraph._capture`` runs. Prints every call's capture phases
(the decode batch's log line) and the profile's top functions by their own and by cumulative time.

    python -m scripts.profile_capture --methods streamingllm,full --length 16000 --batch 8
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import pstats

import torch

from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.graphs import DecodeGraph
from scripts.profile_decode import configs, setup


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=30)
    args, _, lm, prompt = setup(parser, steps=0, top=25)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, len(lm.tokenizer), (args.length - 2 * i,), generator=generator).tolist()
               for i in range(args.batch)]
    capture = DecodeGraph._capture
    profiler = cProfile.Profile()
    for name in args.methods.split(","):
        _, method = configs(args.model, name)
        engine = Engine(lm.model, method, Budget("fraction", args.budget), batch_size=args.batch)
        for call in range(args.calls):
            def profiled(graph, decisions, on=call > 0):
                if not on:
                    return capture(graph, decisions)
                profiled.count += 1
                profiler.enable()
                try:
                    return capture(graph, decisions)
                finally:
                    profiler.disable()

            profiled.count = 0
            DecodeGraph._capture = profiled
            try:
                print(f"== {name}, call {call}", flush=True)
                engine.generate(prompts, args.new_tokens, stop_token_ids=set())
            finally:
                DecodeGraph._capture = capture
        if not profiled.count:
            print(f"== {name}: no capture profiled (CUDA graphs need a CUDA model)")
            continue
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(args.top)
            print(f"== {name}: the captures of calls 1..{args.calls - 1}, by {key}")
            print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:7000], flush=True)
        profiler = cProfile.Profile()


if __name__ == "__main__":
    main()
