"""Where a decode step's time goes: the CUDA kernels of a few steps, eager and replayed as a CUDA graph.

    python scripts/profile_decode.py --model llama3.1-8b-shape-random --methods full,h2o --length 32768

Prints, per method and mode, the step time and the kernels that take most of it (count per step, total
microseconds per step), from torch.profiler's CUDA activity (CUPTI also sees kernels inside graph replays).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from torch.profiler import ProfilerActivity, profile

from kvbench import models
from kvbench.__main__ import CONF_DIR
from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.graphs import DecodeGraph


def configs(model: str, method: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={model}", f"method={method}"])
    return cfg.model, instantiate(cfg.method)


def setup(parser: argparse.ArgumentParser, steps: int, top: int):
    """The profilers' shared arguments, the model they name and a random prompt of ``--length`` tokens."""
    parser.add_argument("--model", default="llama3.1-8b-shape-random")
    parser.add_argument("--methods", default="full,h2o")
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--top", type=int, default=top)
    args = parser.parse_args()
    model_cfg, _ = configs(args.model, "full")
    lm = models.load(model_cfg)
    prompt = torch.randint(0, len(lm.tokenizer), (args.length,), generator=torch.Generator().manual_seed(0)).tolist()
    return args, model_cfg, lm, prompt


def stepper(session, graphs: bool):
    """A function running one greedy decode step of ``session`` (replayed as a CUDA graph with ``graphs``)."""
    token = session.logits.argmax(-1, keepdim=True)

    def body(static_shapes: bool) -> None:
        session.feed(token, "decode", static_shapes)
        token.copy_(session.logits.argmax(-1, keepdim=True))

    return DecodeGraph([session], body).step if graphs else lambda: body(False)


def steps(step, count: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(count):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / count


def kernel_table(prof, count: int, top: int) -> list[str]:
    totals, calls = defaultdict(float), defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time_total
            calls[event.name] += 1
    total = sum(totals.values()) / count
    lines = [f"    kernels: {sum(calls.values()) / count:.0f} per step, {total:.0f} us of GPU time per step"]
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"    {us / count:8.1f} us  x{calls[name] / count:5.1f}  {name[:110]}")
    return lines


def main() -> None:
    args, _, lm, prompt = setup(argparse.ArgumentParser(), steps=8, top=18)
    for name in args.methods.split(","):
        _, method = configs(args.model, name)
        for graphs in (False, True):
            engine = Engine(lm.model, method, Budget("fraction", args.budget), cuda_graphs=graphs)
            session = engine.prefill([prompt], max_new_tokens=4 * args.steps + 8)
            step = stepper(session, graphs)
            steps(step, args.steps)  # warm-up: compile, capture
            seconds = steps(step, args.steps)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                steps(step, args.steps)
            print(f"== {name} {'graphs' if graphs else 'eager'}: {seconds * 1e3:.2f} ms per step")
            print("\n".join(kernel_table(prof, args.steps, args.top)), flush=True)
            del session, step
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
