"""The chunked prompt pass against the unchunked one, in one process (GPU): TTFT (prompt pass + compression)
and peak memory above the weights, unchunked and in ``--chunk``-token chunks, with plain ``model.generate``'s
peak (one new token) as the memory reference.

    python scripts/bench_chunked_prefill.py --model llama3.1-8b-shape-random --methods full --length 32768

Targets (issue 21), full cache at 32k: chunked (4096) TTFT <= 1.3x unchunked; chunked peak above the weights
about 0.17x plain generate's (what the reference path reached).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.memory import PeakMemory
from scripts.profile_decode import configs, setup


def timed(device, weights: int, work) -> tuple[float, int]:
    """Seconds and peak bytes above the weights of ``work()``."""
    with PeakMemory(device, baseline=weights) as peak:
        torch.cuda.synchronize()
        start = time.perf_counter()
        work()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return seconds, peak.bytes - weights


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args, _, lm, prompt = setup(parser, steps=0, top=0)
    model, device = lm.model, lm.model.device
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        _, plain = timed(device, weights, lambda: model.generate(ids, max_new_tokens=1, do_sample=False,
                                                                 attention_mask=torch.ones_like(ids), pad_token_id=0))
    print(f"plain generate (1 new token): peak above weights {plain / 2**30:.2f} GiB")
    for name in args.methods.split(","):
        _, method = configs(args.model, name)
        results = {}
        for chunk in (None, args.chunk):
            engine = Engine(model, method, Budget("fraction", args.budget), prefill_chunk_size=chunk)
            engine.prefill([prompt], max_new_tokens=1)  # warm-up: kernels compiled
            tries = [timed(device, weights, lambda: engine.prefill([prompt], max_new_tokens=1))
                     for _ in range(args.repeats)]
            results[chunk] = statistics.median(t for t, _ in tries), max(p for _, p in tries)
            ttft, peak = results[chunk]
            print(f"{name:>12} chunk {str(chunk):>5}: TTFT {ttft:.3f} s, peak above weights {peak / 2**30:.2f} GiB "
                  f"({peak / plain:.2f}x plain generate's)", flush=True)
        ratio = results[args.chunk][0] / results[None][0]
        print(f"{name:>12} chunked / unchunked TTFT: {ratio:.2f} (target <= 1.3)")


if __name__ == "__main__":
    main()
