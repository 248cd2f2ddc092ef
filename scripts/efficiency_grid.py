"""The efficiency grid: each (model, method, context length) is one ordinary kvbench run
(``python -m kvbench task=efficiency model=M method=X budget=B task.context_lengths=[N] ...``: same composed
config, same run id, same files under ``--root``), all in one process so that each model is built once.

A run over ``--limit-s`` is stopped (SIGALRM) and recorded as infeasible with the seconds it had used; the
method's longer contexts are then skipped. Lengths run in order, every method at one length before the
next. Runs are not started past ``--deadline-s``. Every outcome is a line of ``<root>/grid.jsonl``;
``scripts/efficiency_targets.py`` turns the collected rows into the table of ratios against the targets.

    python scripts/efficiency_grid.py --root /tmp/eff --models smollm2-135m-instruct \
        --methods full,streamingllm,snapkv --lengths 4096 --repeats 3 --warmup 1 --new-tokens 32
    # on a GPU: --models llama3.1-8b-shape-random --lengths 32768,65536 --override engine.cuda_graphs=true
"""

from __future__ import annotations

import argparse
import gc
import json
import signal
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from kvbench import models, runner
from kvbench.__main__ import CONF_DIR


class RunTimeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise RunTimeout()


def cached_loader():
    """``models.load`` keeping one LanguageModel per model name (the runner calls it once per run)."""
    load, built = models.load, {}

    def load_once(cfg):
        if cfg.name not in built:
            built.clear()  # one shape on the GPU at a time
            gc.collect()
            torch.cuda.empty_cache()
            built[cfg.name] = load(cfg)
        return built[cfg.name]

    return load_once


def overrides(args, model: str, method: str, length: int) -> list[str]:
    out = [f"model={model}", f"method={method}", f"budget='{args.budget}'", "task=efficiency",
           f"task.context_lengths=[{length}]", f"task.repeats={args.repeats}", f"task.warmup={args.warmup}",
           f"task.new_tokens={args.new_tokens}", f"results_root={args.root}", *args.override]
    if args.attn != "sdpa":
        out.append(f"model.attn_implementation={args.attn}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--models", required=True)
    parser.add_argument("--methods", required=True)
    parser.add_argument("--lengths", required=True)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--budget", default="0.2")
    parser.add_argument("--override", action="append", default=[],
                        help="extra config override for every run, e.g. engine.cuda_graphs=true (repeatable)")
    parser.add_argument("--limit-s", type=float, default=120.0)
    parser.add_argument("--deadline-s", type=float, default=500.0)
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    models.load = cached_loader()
    signal.signal(signal.SIGALRM, _on_alarm)
    log = (args.root / "grid.jsonl").open("a")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        for model in args.models.split(","):
            stopped_at: dict[str, int] = {}  # method -> the length at which it ran over the limit
            for length in map(int, args.lengths.split(",")):  # every method at a length before the next
                for method in args.methods.split(","):
                    entry = {"model": model, "method": method, "context_length": length, "attn": args.attn,
                             "overrides": args.override}
                    left = args.deadline_s - (time.perf_counter() - start)
                    if method in stopped_at:
                        entry.update(status="skipped", reason=f"over the limit at {stopped_at[method]}")
                    elif left < 15:
                        entry.update(status="not_started", reason="deadline")
                    else:
                        entry.update(run_once(args, model, method, length, min(args.limit_s, left)))
                        if entry["status"] == "timeout":
                            stopped_at[method] = length
                    log.write(json.dumps(entry) + "\n")
                    log.flush()
                    print("GRID", json.dumps(entry), flush=True)


def run_once(args, model: str, method: str, length: int, limit: float) -> dict:
    cfg = compose(config_name="config", overrides=overrides(args, model, method, length))
    t0 = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        run_dir = runner.run(cfg)
        result = {"status": "ok", "run_dir": str(run_dir)}
    except RunTimeout:
        result = {"status": "timeout", "limit_s": round(limit, 1)}
    except Exception as err:  # noqa: BLE001 - recorded, the grid goes on
        result = {"status": "error", "error": f"{type(err).__name__}: {err}"[:500]}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    result["seconds"] = round(time.perf_counter() - t0, 2)
    gc.collect()
    torch.cuda.empty_cache()
    return result


if __name__ == "__main__":
    main()
