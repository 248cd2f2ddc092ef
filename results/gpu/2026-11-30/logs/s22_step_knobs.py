"""Replayed decode steps against kernel-module constants, in one process, interleaved (twenty-second session).
Per method: one prefill, then rounds in which every combination of the ``--set`` values captures its own decode
graph (graphs + compile, as ``task=efficiency`` runs) and replays ``--steps`` steps; the median step per
combination and its ratio to the first combination. Constants as ``scripts/bench_ems_kernels.py --set`` names them
(e.g. ``slots.PROGRAMS_PER_SM=8,2,1``: the side lanes' best-match grids).

    PYTHONPATH=/tmp/site:$PWD python3 results/gpu/2026-11-30/logs/s22_step_knobs.py --methods full,ems \
        --set slots.PROGRAMS_PER_SM=8,2,1
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections import defaultdict

import torch

from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.kernels import triton_decode
from scripts.bench_ems_kernels import MODULES, parse_overrides
from scripts.profile_decode import configs, setup, stepper, steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--set", action="append", default=[])
    args, _, lm, prompt = setup(parser, steps=30, top=0)
    overrides = parse_overrides(args.set, parser)
    choices = list(itertools.product(*(values for _, values in overrides)))
    labels = [", ".join(f"{m}.{n}={v}" for ((m, n), _), v in zip(overrides, choice)) for choice in choices]
    for name in args.methods.split(","):
        _, method = configs(args.model, name)
        graphs = lm.model.device.type == "cuda"  # a CPU run checks the script
        engine = Engine(lm.model, method, Budget("fraction", args.budget), cuda_graphs=graphs, compile=graphs)
        session = engine.prefill([prompt], max_new_tokens=(args.rounds + 1) * len(choices) * (args.steps + 4) + 8)
        times = defaultdict(list)
        for round_ in range(args.rounds + 1):
            for choice, label in zip(choices, labels):
                for ((module, constant), _), value in zip(overrides, choice):
                    setattr(MODULES[module], constant, value)
                triton_decode._programs_wanted.cache_clear()
                step = stepper(session, graphs)
                steps(step, 3)  # capture
                seconds = steps(step, args.steps)
                if round_:  # round 0 warms up: compiles
                    times[label].append(seconds * 1e3)
                del step
        base = statistics.median(times[labels[0]])
        for label in labels:
            ms = statistics.median(times[label])
            print(f"{name:>10} {label}: median {ms:.3f} ms a step ({ms / base:.3f} x the first); rounds "
                  + ", ".join(f"{v:.3f}" for v in times[label]), flush=True)
        del session, engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
