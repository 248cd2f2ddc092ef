"""Does a graph's side branch alone slow a replayed step? The full cache's 32k step replayed plain, then with each
decoder layer forking one trivial kernel (a one-element add) to one of ``--lanes`` side streams after it, joined
before the step ends, the way ``engine.LayerLanes`` forks an observing method's eviction. Steps that fork lanes
idled 0.3 ms more than the full cache's (2026-11-29, sixteenth session, call 4), spread over every gap between
two main-stream kernels (0.45 us against 0.11). If the trivial branches reproduce that, a graph having branches
costs it, whatever they run.

    PYTHONPATH=/tmp/site:$PWD python3 results/gpu/2026-11-29/logs/s16_branch_probe.py --length 32768 --lanes 32
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from kvbench.budget import Budget
from kvbench.engine import Engine, LayerLanes
from scripts.profile_decode import configs, setup, stepper, steps, timeline_lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lanes", type=int, default=32)
    args, _, lm, prompt = setup(parser, steps=8, top=0)
    _, method = configs(args.model, "full")
    layers = lm.model.model.layers
    device = lm.model.device
    scratch = torch.zeros(1, device=device)
    for branches in (False, True, False, True):
        # not compiled (profile_decode's "graphs" mode, where the idle was measured): hooks stay outside dynamo
        engine = Engine(lm.model, method, Budget("fraction", args.budget), cuda_graphs=True, compile=False)
        session = engine.prefill([prompt], max_new_tokens=4 * args.steps + 8)
        handles, lanes = [], {}
        if branches:
            def open_lanes(module, inputs):  # per pass, as Session.plan: forks from the stream that runs (captures) it
                lanes["pass"] = LayerLanes(device, args.lanes)

            def fork(index):
                with lanes["pass"].fork(index):
                    scratch.add_(1)
            handles = [layers[0].register_forward_pre_hook(open_lanes)]
            handles += [layer.register_forward_hook(lambda m, i, o, index=index: fork(index))
                        for index, layer in enumerate(layers)]
            handles.append(lm.model.model.norm.register_forward_hook(lambda m, i, o: lanes["pass"].join()))
        step = stepper(session, True)
        steps(step, args.steps)  # warm-up, capture
        seconds = steps(step, args.steps)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            steps(step, args.steps)
        print(f"== branches {branches}: {seconds * 1e3:.3f} ms a step", flush=True)
        print("\n".join(timeline_lines(prof, args.steps, gaps=3)), flush=True)
        for handle in handles:
            handle.remove()
        del session, step


if __name__ == "__main__":
    main()
