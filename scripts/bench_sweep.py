"""A fused sweep against the same points run one after the other, measured in one process.

The sweep's points (Hydra overrides, ``-m`` style: ``method=a,b budget=0.2``) run alone one after the other
(``runner.run``, as ``kvbench -m ... sweep.fuse=false`` runs them) under one fresh results root, then as one
fused group (``kvbench.sweep.run_group``) under another. Walls are the runs' own ``wall_seconds`` (their
samples' prefill, decoding and scoring; not the model load): the points' sum alone, the group's once fused.
Prints both walls, their ratio, the fused wall over the full cache's alone, and the share of predictions
(per point and sample) that are identical.

    python scripts/bench_sweep.py                       # CPU: SmolLM2-135M, NIAH default, 4 points
    python scripts/bench_sweep.py --alone full method=full,snapkv,... budget=0.1,0.2,0.5   # only full alone

Targets (issue 22): CPU, the default 4 points: fused / one after the other <= 0.5, every prediction identical.
GPU, Llama-3.1-8B shape, NIAH 16k, 8 depths, 30 new tokens: fused / full alone <= 2 for the 6-point sweep
(full, StreamingLLM, SnapKV, TOVA, H2O, Chelsea at 0.2), <= 6 for the 36-point sweep (12 methods x 3 budgets).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import pandas as pd
from omegaconf import open_dict

from kvbench import runner, sweep
from kvbench.__main__ import composed_points, quote_numeric_choices

DEFAULT_POINTS = ["method=full,streamingllm,snapkv,h2o", "budget=0.2"]
CPU_RATIO_TARGET = 0.5


def points(overrides: list[str], root: Path) -> list:
    """The sweep's composed points, results under ``root``, without their Hydra node (no Hydra job runs them)."""
    cfgs = composed_points(["-m", *quote_numeric_choices(overrides), f"results_root={root}"])
    for cfg in cfgs:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfgs


def outputs(root: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(predictions, one metrics row per run) of a results root."""
    predictions = pd.read_parquet(root / "predictions.parquet")
    metrics = pd.read_parquet(root / "metrics.parquet").drop_duplicates("run_id").set_index("run_id")
    return predictions, metrics


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--alone", default="all", help="the methods run alone: all (default), or a comma list")
    args, overrides = parser.parse_known_args(argv)
    overrides = overrides or DEFAULT_POINTS
    with tempfile.TemporaryDirectory(prefix="kvbench-bench-sweep-") as tmp:
        alone_root, fused_root = Path(tmp) / "alone", Path(tmp) / "fused"
        for cfg in points(overrides, alone_root):
            if args.alone == "all" or runner.method_name(cfg) in args.alone.split(","):
                runner.run(cfg)
        group = [(cfg, None, None) for cfg in points(overrides, fused_root)]
        outcomes = sweep.run_group(group, memory_gb=group[0][0].sweep.memory_gb)
        failed = [detail for state, detail in outcomes if state == "failed"]
        if failed:
            print("fused group: failed points:", *failed, sep="\n  ", file=sys.stderr)
            return 1
        alone, alone_runs = outputs(alone_root)
        fused, fused_runs = outputs(fused_root)
    report(overrides, alone, alone_runs, fused, fused_runs, complete=args.alone == "all")
    return 0


def report(overrides, alone, alone_runs, fused, fused_runs, complete: bool) -> None:
    fused_wall = float(fused_runs["wall_seconds"].iloc[0])
    alone_wall = float(alone_runs["wall_seconds"].sum())
    full = alone_runs[alone_runs["method"] == runner.FULL]["wall_seconds"]
    first = fused_runs.iloc[0]
    print(f"{len(fused_runs)} points ({' '.join(overrides)}) on {first['model']} / {first['task']}, "
          f"{int(first['n_samples'])} samples, {first['device']}")
    print(f"one after the other: {alone_wall:8.2f} s ({len(alone_runs)} runs)")
    print(f"fused:               {fused_wall:8.2f} s (group of {int(first['fused_group_size'])})")
    if complete:
        print(f"fused / one after the other: {fused_wall / alone_wall:.3f} (CPU target <= {CPU_RATIO_TARGET})")
    if len(full):
        print(f"fused / full cache alone: {fused_wall / float(full.iloc[0]):.3f} "
              f"(GPU targets: <= 2 for 6 points, <= 6 for 36)")
    print(f"{'point':<24}{'alone wall':>12}{'TTFT alone':>12}{'TTFT fused':>12}{'TPOT alone':>12}{'TPOT fused':>12}")
    for rid, run in fused_runs.iterrows():
        alone_run = alone_runs.loc[rid] if rid in alone_runs.index else None
        cells = [f"{run['method']} {run['budget']}"]
        cells += ["-" if alone_run is None else f"{alone_run['wall_seconds']:.2f} s"]
        for column, scale, unit in (("ttft_seconds", 1, "s"), ("tpot_seconds", 1000, "ms")):
            cells += ["-" if alone_run is None else f"{scale * alone_run[column]:.2f} {unit}",
                      f"{scale * run[column]:.2f} {unit}"]
        print(f"{cells[0]:<24}" + "".join(f"{c:>12}" for c in cells[1:]))
    key = ["run_id", "sample_id"]
    both = alone[key + ["prediction"]].merge(fused[key + ["prediction"]], on=key, suffixes=("_alone", "_fused"))
    same = int((both["prediction_alone"] == both["prediction_fused"]).sum())
    print(f"identical predictions: {same} / {len(both)} ({100 * same / max(1, len(both)):.1f} %)")
    for rid, rows in both[both["prediction_alone"] != both["prediction_fused"]].groupby("run_id"):
        print(f"  {fused_runs.loc[rid, 'method']} {fused_runs.loc[rid, 'budget']}: {len(rows)} differ")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
