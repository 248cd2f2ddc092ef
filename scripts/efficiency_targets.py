"""The efficiency targets of issue 21 (GPU) and of the CPU profile, target beside measured, from an efficiency results root.

Every ratio comes from one kvbench efficiency run, in which the method, the full cache through kvbench and
plain ``model.generate`` ran on the same prompt (``kvbench.tasks.efficiency``): nothing is compared across
runs. Rows are grouped by model, engine switches (CUDA graphs, prefill chunk) and context length.

    python scripts/efficiency_targets.py --root /tmp/eff --profile gpu --out targets.md
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd

PROMPT_ONLY = ("snapkv", "pyramidkv", "kvmerger")
LATENCY, THROUGHPUT = "bs1", "throughput"  # the efficiency task's cells: batch-1 latency, largest-batch search
# (label, methods it applies to, metric, bound, direction, contexts, cell, which runs: graphs / chunk)
TPOT, TTFT = "ratio.method_vs_full.tpot_seconds", "ratio.method_vs_full.ttft_seconds"
# beside a TPOT ratio: the same ratio without each system's first decode step (where a decode batch records its
# CUDA graph), so that a miss says whether the one-off first step or every step costs it
AFTER_FIRST = "ratio.method_vs_full.tpot_after_first_seconds"
# KVMerger keeps every slot of a random-weight model (no key pair passes its similarity threshold), so where a
# target asks for a smaller cache's speed it has its own row
COMPRESSING = "all but kvmerger"
GRAPHS = (True, None)
# (label, methods it applies to, metric, bound, direction, contexts, cell, which runs: graphs / chunk); issue 21's
GPU_TARGETS = [
    ("full: bytes-read bound / TPOT", ("full",), "full.bound_fraction", 0.70, ">=", (32768,), LATENCY, GRAPHS),
    ("TPOT / kvbench full", "all", TPOT, 1.05, "<=", (32768,), LATENCY, GRAPHS),
    ("TTFT / kvbench full", "all", TTFT, 1.15, "<=", (32768,), LATENCY, GRAPHS),
    ("TPOT / kvbench full", COMPRESSING, TPOT, 0.85, "<=", (65536,), LATENCY, GRAPHS),
    ("TPOT / kvbench full", ("kvmerger",), TPOT, 1.05, "<=", (65536,), LATENCY, GRAPHS),
    ("peak above weights / plain generate", "all", "ratio.method_vs_bare.peak_memory_above_weights_bytes", 0.60,
     "<=", (32768,), LATENCY, GRAPHS),
    ("throughput: largest batch / full's", COMPRESSING, "ratio.method_vs_full.max_batch", 3.5, ">=", (16384,),
     THROUGHPUT, GRAPHS),
    ("throughput: decode tokens/s / full's", COMPRESSING, "ratio.method_vs_full.decode_tokens_per_second", 4.0,
     ">=", (16384,), THROUGHPUT, GRAPHS),
    ("throughput: bytes-read bound / TPOT at the largest batch", COMPRESSING, "method.bound_fraction", 0.70, ">=",
     (16384,), THROUGHPUT, GRAPHS),
]
CPU_TARGETS = [
    ("full TPOT / plain generate", ("full",), "ratio.full_vs_bare.tpot_seconds", 1.15, "<=", (4096,), LATENCY,
     (False, None)),
    ("TPOT / kvbench full", "decode", TPOT, 1.30, "<=", (4096,), LATENCY, (False, None)),
    ("TTFT / kvbench full", "all", TTFT, 1.50, "<=", (4096,), LATENCY, (False, None)),
]


def load(root: Path) -> pd.DataFrame:
    frames = [pd.read_parquet(p) for p in sorted((root / "runs").glob("*/metrics.parquet"))]
    if not frames:
        raise SystemExit(f"no finished runs under {root / 'runs'}")
    df = pd.concat(frames, ignore_index=True)
    cell = df["dataset"].str.extract(r"len(\d+)_(bs1|throughput)$")
    df = df[cell[0].notna()].assign(context=cell[0].astype(float).astype(int), cell=cell[1])
    # rows written before the engine switches existed have no engine columns: eager, one pass
    df["graphs"] = df["engine.cuda_graphs"].fillna(False).astype(bool) if "engine.cuda_graphs" in df else False
    chunk = df.get("engine.prefill_chunk_size")
    df["chunk"] = None if chunk is None else chunk.astype(object).where(chunk.notna(), None)
    return df


def applies(methods, method: str, decode_time: set[str]) -> bool:
    if methods == "all":
        return True
    if methods == "decode":
        return method in decode_time
    if methods == COMPRESSING:
        return method != "kvmerger"
    return method in methods


def table(df: pd.DataFrame, targets: list) -> list[dict]:
    decode_time = {m for m in df["method"].unique() if m not in PROMPT_ONLY and m != "full"}
    rows = []
    for label, methods, metric, bound, direction, contexts, cell_kind, (graphs, chunk) in targets:
        where = df["context"].isin(contexts) & (df["graphs"] == graphs) & (df["cell"] == cell_kind)
        where &= df["chunk"].isna() if chunk is None else (df["chunk"] == chunk)
        mask = where & (df["metric"] == metric)
        if methods == ("full",):  # every run times the full cache and plain generate: the median of them all
            for (model, context), cell in df[mask].groupby(["model", "context"]):
                rows.append(row(label, model, context, f"full (median of {len(cell)} runs)",
                                float(cell["value"].median()), bound, direction))
            continue
        after_first = df[where & (df["metric"] == AFTER_FIRST)].groupby(["model", "method", "context"])["value"].first()
        for (model, method, context), cell in df[mask].groupby(["model", "method", "context"]):
            if applies(methods, method, decode_time) and method != "full":
                rows.append(row(label, model, context, method, float(cell["value"].iloc[0]), bound, direction))
                if metric == TPOT and (model, method, context) in after_first.index:
                    rows[-1]["met"] += f"; {after_first[(model, method, context)]:.2f} after the first step"
    return rows


def row(label: str, model: str, context: int, method: str, value: float, bound: float, direction: str) -> dict:
    met = value <= bound if direction == "<=" else value >= bound
    miss = 100 * (value / bound - 1)
    decimals = 1 if abs(miss) < 1 else 0  # a miss under 1 % never prints as "+0%"
    return {"target": label, "model": model, "context": context, "method": method, "measured": value,
            "bound": bound, "direction": direction, "met": "yes" if met else f"no ({miss:+.{decimals}f}%)"}


def markdown(rows: list[dict]) -> str:
    lines = ["| target | model | context | method | measured | target | met |", "|---|---|---:|---|---:|---:|---|"]
    for r in rows:
        # a value that rounds to its bound gets a third digit, so that a miss never reads as "0.85 <= 0.85"
        digits = 3 if f"{r['measured']:.2f}" == f"{r['bound']:.2f}" else 2
        measured = "nan" if math.isnan(r["measured"]) else f"{r['measured']:.{digits}f}"
        lines.append(f"| {r['target']} | {r['model']} | {r['context']} | {r['method']} | {measured} | "
                     f"{r['direction']} {r['bound']:.2f} | {r['met']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--profile", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    text = markdown(table(load(args.root), GPU_TARGETS if args.profile == "gpu" else CPU_TARGETS))
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
