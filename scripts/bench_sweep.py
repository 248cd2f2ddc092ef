"""A fused sweep against the same points run one after the other, measured in one process.

The sweep's points (Hydra overrides, ``-m`` style: ``method=a,b budget=0.2``, with the settings they share) run
alone one after the other (``runner.run``, as ``kvbench -m ... sweep.fuse=false`` runs them) under one fresh
results root, then as one fused group (``kvbench.sweep.run_group``) under another. Walls are the runs' own
``wall_seconds`` (their samples' prefill, decoding and scoring; not the model load), after untimed warm-up
runs (``warm_up``: compilation at the sweep's batch size, for every point). Prints both walls, their ratio, the
fused wall over the full cache's alone, the share of predictions (per point and sample) that are identical, and
per point its TTFT and in-run TPOT alone and fused; the runs' own output goes to stderr. Options:

* ``--alone M,N``: only these methods run alone (``none``: none); the one-after-the-other ratio needs all;
* ``--wide "method=... budget=..."``: a second sweep of the same settings with these points, run fused only,
  its wall over the full cache's alone;
* ``--tpot``: each method's batch-1 TPOT on the first sample's prompt (``engine.generate`` of one prompt with
  no stop token, as ``task=efficiency`` times it), against its in-run TPOT at the sweep's ``batch_size``; and
  the same two for the replayed steps alone (a decode batch's log record: its steps and device seconds by
  kind), without the step that captures the batch's graph (once per decode batch: a run's, a ``generate``'s).

The wide sweep runs twice: cold (its first run in the process: compilation of its points' kernels at its batch
and table shapes included) and warm (the wall its ratio uses).

    python -m scripts.bench_sweep         # CPU: SmolLM2-135M, NIAH default, 4 points (full, StreamingLLM, SnapKV, H2O)

Targets (issue 22): CPU, the default 4 points: fused / one after the other <= 0.5, every prediction identical.
GPU (``bash scripts/gpu_session.sh sweep``: Llama-3.1-8B shape, NIAH 16k, 8 depths, 30 new tokens, batch 8):
fused / full alone <= 2 for the 6-point sweep (full, StreamingLLM, SnapKV, TOVA, H2O, Chelsea at 0.2), <= 6 for
the 36-point sweep (12 methods x 0.2, 0.35, 0.5); in-run TPOT at batch 8 / batch-1 TPOT <= 1.3.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf, open_dict

from kvbench import models, runner, store, sweep
from kvbench.__main__ import composed_points, quote_numeric_choices
from kvbench.memory import release_memory
from kvbench.tasks.base import generation_calls
from scripts.bench_decode_loop import in_run_tpot

DEFAULT_POINTS = ["method=full,streamingllm,snapkv,h2o", "budget=0.2"]
CPU_RATIO_TARGET = 0.5
POINT_OVERRIDES = ("method=", "budget=", "method.")  # what ``--wide`` replaces


def points(overrides: list[str], root: Path) -> list:
    """The sweep's composed points, results under ``root``, without their Hydra node (no Hydra job runs them)."""
    cfgs = composed_points(["-m", *quote_numeric_choices(overrides), f"results_root={root}"])
    for cfg in cfgs:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfgs


def outputs(root: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(predictions, one metrics row per run, by run id) of a results root."""
    predictions = pd.read_parquet(root / "predictions.parquet")
    metrics = pd.read_parquet(root / "metrics.parquet").drop_duplicates("run_id").set_index("run_id")
    return predictions, metrics


def warm_up(cfgs: list, overrides: list[str], root: Path) -> None:
    """Untimed, as ``task=efficiency`` warms up before it times: every point alone on one batch of samples, then
    the group on one sample, so that the timed runs find their kernels compiled at the sweep's batch size and at
    the group's (Triton specialises on a batch of 1, ``engine.compile`` compiles per shape) and their decode
    steps warmed up (a timed batch then captures its graph at its first step)."""
    batch = cfgs[0].batch_size if isinstance(cfgs[0].batch_size, int) else 1
    for cfg in cfgs:
        runner.run(OmegaConf.merge(cfg, {"limit": batch, "results_root": str(root / "alone")}))
        release_memory()
    if len(cfgs) > 1:
        run_fused([*(o for o in overrides if not o.startswith("limit=")), "limit=1"], root / "fused")


def run_fused(overrides: list[str], root: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    group = [(cfg, None, None) for cfg in points(overrides, root)]
    outcomes = sweep.run_group(group, memory_gb=group[0][0].sweep.memory_gb)
    release_memory()
    failed = [detail for state, detail in outcomes if state == "failed"]
    if failed:
        sys.exit("fused group: failed points:\n  " + "\n  ".join(failed))
    return outputs(root)


class DecodeBatches(logging.Handler):
    """The decode batches' log records (``DecodeBatch.close``) while it is attached: their steps and device
    seconds by kind."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.batches: list[tuple[dict, dict]] = []
        self.lines: list[str] = []  # their log lines (steps by kind; what the captures took on the host)

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "steps_by_kind"):
            self.batches.append((record.steps_by_kind, record.seconds_by_kind))
            self.lines.append(record.getMessage())

    def replayed_step_seconds(self) -> float:
        """Device seconds per replayed step of the last batch (nan if none replayed)."""
        steps, seconds = self.batches[-1] if self.batches else ({}, {})
        return seconds.get("replay", 0.0) / steps["replay"] if steps.get("replay") else float("nan")


@contextmanager
def decode_batches():
    handler = DecodeBatches()
    logger = logging.getLogger("kvbench")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))  # the records reach the handler
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def batch_one_tpot(cfgs: list) -> dict[str, tuple[float, float]]:
    """Per method (one engine per point, on one model): TPOT of the first sample's prompt decoded alone, and its
    replayed steps' device seconds per step."""
    cfg = cfgs[0]
    runner.prepare(cfg)
    lm, task = models.load(cfg.model), runner.build_task(cfg)
    [call] = generation_calls([task.build_prompt(runner.load_samples(cfg, task, lm)[0], lm)], lm)
    tpots = {}
    for point in cfgs:
        engine = runner.build_engine(point, lm, *runner.build_method(point))
        label = runner.run_labels(point)
        with decode_batches() as batches:
            tpot = in_run_tpot(engine, call.contexts, call.max_new_tokens, 1)
        tpots[f"{label['method']} {label['budget']}"] = (tpot, batches.replayed_step_seconds())
    del lm, engine
    release_memory()
    return tpots


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--alone", default="all", help="the methods run alone: all (default), none, or a comma list")
    parser.add_argument("--wide", default=None, help="the points of a second sweep run fused only")
    parser.add_argument("--tpot", action="store_true", help="each method's batch-1 TPOT beside its in-run TPOT")
    args, overrides = parser.parse_known_args(argv)
    overrides = overrides or DEFAULT_POINTS
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)  # the runs' logs (decode batches' graph replays)
    with tempfile.TemporaryDirectory(prefix="kvbench-bench-sweep-") as tmp:
        tmp = Path(tmp)
        cfgs = points(overrides, tmp / "alone")
        with redirect_stdout(sys.stderr):  # the runs' progress and tables; stdout is the report's
            warm_up(cfgs, overrides, tmp / "warm-up")
            replayed = {}  # run id -> its decode batch's replayed step seconds
            for cfg in cfgs:
                if args.alone == "all" or runner.method_name(cfg) in args.alone.split(","):
                    with decode_batches() as batches:
                        runner.run(cfg)
                    replayed[store.run_id(runner.result_config(cfg))] = batches.replayed_step_seconds()
                    release_memory()
            alone = outputs(tmp / "alone") if (tmp / "alone" / "metrics.parquet").exists() else None
            fused = run_fused(overrides, tmp / "fused")
        report(overrides, alone, fused, complete=args.alone == "all")
        order = list(dict.fromkeys(store.run_id(runner.result_config(cfg)) for cfg in cfgs))  # sweep order
        report_points(alone, fused, order)
        if args.tpot:  # before the wide sweep, the longest part
            with redirect_stdout(sys.stderr):
                tpots = batch_one_tpot(cfgs)
            report_tpot(alone, fused, tpots, replayed, order)
        if args.wide:
            wide_overrides = [o for o in overrides if not o.startswith(POINT_OVERRIDES)] + args.wide.split()
            with redirect_stdout(sys.stderr):  # cold: the same sweep first, its kernels compiled inside it
                cold = run_fused(wide_overrides, tmp / "wide-cold")
                with decode_batches() as batches:
                    wide = run_fused(wide_overrides, tmp / "wide")
            report_wide(args.wide, alone, wide, cold, batches.lines)
    return 0


def full_alone_wall(alone) -> float | None:
    full = None if alone is None else alone[1][alone[1]["method"] == runner.FULL]["wall_seconds"]
    return None if full is None or not len(full) else float(full.iloc[0])


def report(overrides: list[str], alone, fused, complete: bool) -> None:
    fused_runs = fused[1]
    first = fused_runs.iloc[0]
    fused_wall = float(first["wall_seconds"])
    print(f"{len(fused_runs)} points ({' '.join(overrides)}) on {first['model']} / {first['task']}, "
          f"{int(first['n_samples'])} samples, {first['device']}")
    if alone is not None:
        print(f"one after the other: {alone[1]['wall_seconds'].sum():8.2f} s ({len(alone[1])} runs)")
    print(f"fused:               {fused_wall:8.2f} s (group of {int(first['fused_group_size'])})")
    if complete:
        print(f"fused / one after the other: {fused_wall / alone[1]['wall_seconds'].sum():.3f} "
              f"(CPU target <= {CPU_RATIO_TARGET})")
    full = full_alone_wall(alone)
    if full is not None:
        print(f"fused / full cache alone ({full:.2f} s): {fused_wall / full:.3f} (GPU target <= 2 for 6 points)")
    if alone is not None:
        print(identical(alone, fused))


def report_wide(points_: str, alone, wide, cold, batch_lines: list[str]) -> None:
    first = wide[1].iloc[0]
    line = (f"wide sweep ({points_}): {len(wide[1])} runs fused: {float(first['wall_seconds']):.2f} s "
            f"(its first run, compiling: {float(cold[1].iloc[0]['wall_seconds']):.2f} s)")
    full = full_alone_wall(alone)
    if full is not None:
        line += f"; / full cache alone: {float(first['wall_seconds']) / full:.3f} (GPU target <= 6 for 36 points)"
    print(line)
    print("  " + breakdown(wide))
    print("  " + compressions_by_method(wide))
    for line in batch_lines:
        print("  " + line)
    if alone is not None:
        print(f"  of its runs also run alone: {identical(alone, wide)}")


def breakdown(runs) -> str:
    """Where a fused group's wall went, from its rows' own clocks: the shared prompt passes (per prompt, a
    row's prefill without its own compression and suffix, least over the points; the group prefills a prompt
    once per chunk of points that fit memory), the points' prompt compressions, and decoding (every row's share
    of the decode steps)."""
    predictions = runs[0]
    own = predictions["compress_seconds"]
    passes = (predictions["prefill_seconds"] - own).groupby(predictions["sample_id"]).min().sum()
    wall = float(runs[1].iloc[0]["wall_seconds"])
    return (f"shared prompt passes {passes:.3f} s (once per chunk of points: more where the chunks are several), "
            f"prompt compressions {own.sum():.3f} s ({predictions['run_id'].nunique()} points), "
            f"decode steps {predictions['decode_seconds'].sum():.3f} s, wall {wall:.3f} s")


def compressions_by_method(runs) -> str:
    """The points' prompt compression seconds summed per method, largest first."""
    predictions, metrics = runs
    seconds = predictions.groupby(predictions["run_id"].map(metrics["method"]))["compress_seconds"].sum()
    return "prompt compressions by method: " + ", ".join(
        f"{method} {value:.3f} s" for method, value in seconds.sort_values(ascending=False).items())


def identical(alone, fused) -> str:
    """The share of (run, sample) predictions identical alone and fused, and the points that differ."""
    key = ["run_id", "sample_id"]
    both = alone[0][key + ["prediction"]].merge(fused[0][key + ["prediction"]], on=key, suffixes=("_alone", "_fused"))
    differ = both[both["prediction_alone"] != both["prediction_fused"]]
    line = f"identical predictions: {len(both) - len(differ)} / {len(both)} ({100 * (1 - len(differ) / max(1, len(both))):.1f} %)"
    counts = differ.groupby("run_id").size()
    return line + "".join(f"; {fused[1].loc[rid, 'method']} {fused[1].loc[rid, 'budget']}: {n} differ"
                          for rid, n in counts.items())


def report_points(alone, fused, order: list[str]) -> None:
    """Per point (run ids in ``order``): TTFT and in-run TPOT alone and fused."""
    print("| point | TTFT alone s | TTFT fused s | in-run TPOT alone ms | in-run TPOT fused ms |")
    print("|---|---:|---:|---:|---:|")
    for rid, run in fused[1].loc[order].iterrows():
        solo = solo_run(alone, rid)
        cells = ["-" if solo is None else f"{solo['ttft_seconds']:.2f}", f"{run['ttft_seconds']:.2f}",
                 "-" if solo is None else f"{1e3 * solo['tpot_seconds']:.2f}", f"{1e3 * run['tpot_seconds']:.2f}"]
        print(f"| {run['method']} {run['budget']} | " + " | ".join(cells) + " |", flush=True)


def report_tpot(alone, fused, tpots: dict[str, tuple[float, float]], replayed: dict[str, float],
                order: list[str]) -> None:
    """Per point (run ids in ``order``): batch-1 TPOT, and the in-run TPOTs (at the sweep's batch size) over it;
    then a replayed step at batch 1 and in the run alone, and their ratio (the steady step, without the
    batch's capture)."""
    print("| point | TPOT batch 1 ms | in-run alone / batch 1 (target <= 1.3) | in-run fused / batch 1 "
          "| replayed step batch 1 ms | replayed step in-run alone ms | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for rid, run in fused[1].loc[order].iterrows():
        solo, (one, one_step) = solo_run(alone, rid), tpots[f"{run['method']} {run['budget']}"]
        ratio = "-" if solo is None else f"{solo['tpot_seconds'] / one:.2f}"
        step = replayed.get(rid, float("nan"))
        print(f"| {run['method']} {run['budget']} | {1e3 * one:.2f} | {ratio} | {run['tpot_seconds'] / one:.2f} "
              f"| {1e3 * one_step:.2f} | {1e3 * step:.2f} | {step / one_step:.2f} |", flush=True)


def solo_run(alone, rid: str):
    """The metrics row of run ``rid`` alone, or None where it did not run alone."""
    return alone[1].loc[rid] if alone is not None and rid in alone[1].index else None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
