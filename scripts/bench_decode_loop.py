"""The decode loop's speed on a GPU (issues 21, 22), every ratio measured in this one process.

    python scripts/bench_decode_loop.py --model llama3.1-8b-shape-random \
        --methods full,streamingllm,snapkv,tova,h2o,chelsea --length 16000 --batch 8 --new-tokens 30

Prints three tables:
1. per method, CUDA graphs on (on a CUDA model): TPOT at batch 1 (one prompt through ``engine.generate``, as ``task=efficiency``
   times it), the in-run TPOT of ``--batch`` ragged prompts decoded together (lengths spread like NIAH's depths,
   as a ``task=niah batch_size=8`` run decodes them), the ratio (target <= 1.3), and the in-run TPOT when twice
   as many prompts as slots, with max_new_tokens from a third of ``--new-tokens`` up, leave and join the batch;
2. the host gap: the full cache at ``--gap-length`` tokens, batch 1, replayed steps: wall time per step against
   the GPU time of its kernels (torch.profiler) (target: wall <= 1.05 x kernels);
3. points in one step: every method's batch decoded together (``DecodeBatch`` with one point per method: one
   forward pass per step) against the sum of their in-run TPOTs alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvbench import models
from kvbench.budget import Budget
from kvbench.decode import DecodeBatch, DecodeRequest
from kvbench.engine import Engine
from scripts.profile_decode import configs


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def ragged(length: int, count: int) -> list[int]:
    """Lengths a NIAH run of ``count`` depths gives around ``length`` (the needle's sentence cut differently)."""
    return [length - 37 * i for i in range(count)]


def in_run_tpot(engine: Engine, batch: list[list[int]], new_tokens: int, slots: int,
                max_new: list[int] | None = None) -> float:
    """Mean in-run TPOT of the rows of one decode batch of ``slots`` (the second of two runs: the first compiles)."""
    for _ in range(2):
        if max_new is None:
            gens = engine.generate(batch, new_tokens, stop_token_ids=set(), batch_size=slots)
        else:
            gens = decode(engine, batch, max_new, slots)
    return statistics.mean(g.tpot_seconds for g in gens)


def decode(engines: list[Engine] | Engine, batch: list[list[int]], max_new: list[int], slots: int):
    """Every prompt decoded by every engine (one point each) in one ``DecodeBatch``, rows admitted as slots free."""
    engines = engines if isinstance(engines, list) else [engines]
    batch_rows = DecodeBatch(engines, slots)
    waiting = [(p, prompt, n) for p in range(len(engines)) for prompt, n in zip(batch, max_new)]
    gens = []
    while waiting or batch_rows.busy:
        for item in list(waiting):
            point, prompt, n = item
            if batch_rows.vacancies(point) > 0:
                batch_rows.admit(point, engines[point].prefill_row(prompt, n), DecodeRequest(n))
                waiting.remove(item)
        gens += [done.generation for done in batch_rows.step()]
    batch_rows.close()
    return gens


def host_gap(engine: Engine, prompt: list[int], steps: int) -> tuple[float, float]:
    """(wall seconds, kernel seconds) per replayed step of one row."""
    batch = DecodeBatch([engine], 1)
    batch.admit(0, engine.prefill_row(prompt, 3 * steps + 8), DecodeRequest(3 * steps + 8))
    for _ in range(steps):  # admission, warm-up, capture, replays
        batch.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            batch.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    kernels = sum(e.device_time_total for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    batch.close()
    return wall, kernels / 1e6 / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3.1-8b-shape-random")
    parser.add_argument("--methods", default="full,streamingllm,snapkv,tova,h2o,chelsea")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--length", type=int, default=16000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=30)
    parser.add_argument("--gap-length", type=int, default=32768)
    parser.add_argument("--gap-steps", type=int, default=32)
    args = parser.parse_args()
    model_cfg, _ = configs(args.model, "full")
    lm = models.load(model_cfg)
    vocab = len(lm.tokenizer)
    engines = {name: Engine(lm.model, configs(args.model, name)[1], Budget("fraction", args.budget))
               for name in args.methods.split(",")}  # CUDA graphs on a CUDA model (engine.cuda_graphs=auto)
    batch = prompts(vocab, ragged(args.length, args.batch))
    twice = prompts(vocab, ragged(args.length, 2 * args.batch), seed=1)
    max_new = [args.new_tokens // 3 + (i * (args.new_tokens - args.new_tokens // 3)) // (2 * args.batch)
               for i in range(2 * args.batch)]
    print(f"== 1. in-run TPOT, {args.model}, {args.length} tokens, batch {args.batch}, {args.new_tokens} new tokens",
          flush=True)
    print("| method | TPOT batch 1 ms | in-run TPOT batch ms | ratio (target <= 1.3) | leave-and-join TPOT ms |")
    print("|---|---:|---:|---:|---:|")
    alone = {}
    for name, engine in engines.items():
        one = in_run_tpot(engine, batch[:1], args.new_tokens, 1)
        alone[name] = in_run_tpot(engine, batch, args.new_tokens, args.batch)
        churn = in_run_tpot(engine, twice, args.new_tokens, args.batch, max_new)
        print(f"| {name} | {one * 1e3:.2f} | {alone[name] * 1e3:.2f} | {alone[name] / one:.2f} | {churn * 1e3:.2f} |",
              flush=True)
    if "full" in engines and lm.model.device.type == "cuda":
        wall, kernels = host_gap(engines["full"], prompts(vocab, [args.gap_length], seed=2)[0], args.gap_steps)
        print(f"== 2. host gap, full cache, {args.gap_length} tokens, batch 1, replayed steps: wall {wall * 1e3:.2f} ms"
              f", kernels {kernels * 1e3:.2f} ms, ratio {wall / kernels:.3f} (target <= 1.05)", flush=True)
    gens = decode(list(engines.values()), batch, [args.new_tokens] * len(batch), args.batch)
    fused = statistics.mean(g.tpot_seconds for g in gens)
    print(f"== 3. {len(engines)} points x {args.batch} rows in one step: TPOT {fused * 1e3:.2f} ms against "
          f"{sum(alone.values()) * 1e3:.2f} ms for the points one after the other (ratio "
          f"{fused / sum(alone.values()):.2f})", flush=True)


if __name__ == "__main__":
    main()
