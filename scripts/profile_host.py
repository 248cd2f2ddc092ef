"""Where an eager decode step's host time goes (Python + dispatch), per method: cProfile of a few steps.

    python -m scripts.profile_host --model llama3.1-8b-shape-random --methods full,h2o --length 32768
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

from kvbench.attention import attach
from kvbench.budget import Budget
from kvbench.engine import Engine
from scripts.profile_decode import configs, setup


def main() -> None:
    args, model_cfg, lm, prompt = setup(argparse.ArgumentParser(), steps=10, top=22)
    for name in args.methods.split(","):
        _, method = configs(args.model, name)
        session = Engine(lm.model, method, Budget("fraction", args.budget)).prefill([prompt], 2 * args.steps + 4)
        with attach(lm.model, model_cfg.attn_implementation):
            for _ in range(3):
                session.feed(session.logits.argmax(-1).view(-1, 1))
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.steps):
                session.feed(session.logits.argmax(-1).view(-1, 1))
            torch.cuda.synchronize()
            profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
        print(f"== {name}: host profile of {args.steps} eager steps")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000], flush=True)


if __name__ == "__main__":
    main()
