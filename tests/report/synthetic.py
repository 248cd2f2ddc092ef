"""A small results root with known values, written through ``kvbench.store`` exactly as runs write it.

Model llama2-7b-chat (so the papers' EMS/KVMerger rows match). LongBench (4 datasets x 3 samples, metric
rows from the real ``LongBench.aggregate``), passkey (2 lengths x 2 depths), PG19 perplexity-by-position rows
and efficiency cells. Methods: full (at budgets 0.5 and tokens256: one "full" row), h2o (0.5, tokens256, tokens128),
snapkv (tokens256), ems with positions=without/with (tokens256: two variant rows)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from kvbench import store
from kvbench.tasks.base import Task
from kvbench.tasks.efficiency import Efficiency
from kvbench.tasks.longbench import LongBench

MODEL = "llama2-7b-chat"
LONGBENCH = ("narrativeqa", "qasper", "hotpotqa", "trec")
# per-sample LongBench scores of two rows, by hand (3 samples per dataset)
FIXED_SCORES = {
    ("full", "0.5"): {"narrativeqa": [0.3, 0.2, 0.1], "qasper": [0.5, 0.5, 0.2], "hotpotqa": [1.0, 0.0, 0.5],
                      "trec": [1.0, 1.0, 0.0]},
    ("h2o", "0.5"): {"narrativeqa": [0.2, 0.2, 0.2], "qasper": [0.4, 0.4, 0.1], "hotpotqa": [1.0, 0.0, 0.0],
                     "trec": [1.0, 0.0, 0.0]},
}
RUNS = [  # method, budget kind, budget value, method hyperparameters
    ("full", "fraction", 0.5, {}), ("full", "tokens", 256, {}), ("h2o", "fraction", 0.5, {"recent": 0.5}),
    ("h2o", "tokens", 256, {"recent": 0.5}), ("h2o", "tokens", 128, {"recent": 0.5}), ("snapkv", "tokens", 256, {"window": 32}),
    ("ems", "tokens", 256, {"positions": "without"}), ("ems", "tokens", 256, {"positions": "with"}),
]
N_LAYERS, N_HEADS = 3, 2


def label(kind: str, value) -> str:
    return f"{value:g}" if kind == "fraction" else f"tokens{int(value)}"


def kept(method: str, kind: str, value, prompt_length: int) -> list[list[int]]:
    """(layers, heads) kept slots: full keeps all; others keep the budget, layer l scaled by (l+1)/L*1.5."""
    n = prompt_length if method == "full" else (round(value * prompt_length) if kind == "fraction" else value)
    return [[min(prompt_length, int(n * (l + 1) * 1.5 / N_LAYERS) + h) for h in range(N_HEADS)] for l in range(N_LAYERS)]


def longbench_predictions(method, budget, kind, value, rng) -> pd.DataFrame:
    scores = FIXED_SCORES.get((method, budget)) or {d: rng.integers(0, 5, 3) / 4 for d in LONGBENCH}
    if method == "full":
        scores = FIXED_SCORES[("full", "0.5")]  # the full cache does not depend on the budget
    rows = []
    for dataset, values in scores.items():
        for i, v in enumerate(values):
            rows.append({"sample_id": f"{dataset}-{i}", "dataset": dataset, "prompt_length": 1000 + 100 * i,
                         "metric.score": float(v), "tpot_seconds": 0.02, "peak_memory_bytes": 2**30,
                         "kept_per_layer_head": kept(method, kind, value, 1000 + 100 * i)})
    return pd.DataFrame(rows)


def passkey_predictions(method, kind, value) -> pd.DataFrame:
    rows = []
    for length in (1000, 2000):
        for depth in (0.0, 100.0):
            hit = method == "full" or depth == 100.0 or (method == "ems" and length == 1000)
            rows.append({"sample_id": f"passkey-{length}-{depth:g}-0", "dataset": "passkey", "prompt_length": length,
                         "meta.context_length": length, "meta.depth": depth, "metric.exact_match": float(hit),
                         "metric.partial_match": 1.0 if hit else 0.4,
                         "tpot_seconds": 0.01 + length * (2e-5 if method == "full" else 1e-5),
                         "peak_memory_bytes": length * (2**20 if method == "full" else 2**19),
                         "kept_per_layer_head": kept(method, kind, value, length)})
    return pd.DataFrame(rows)


def pg19_metrics(method, value) -> list[dict]:
    base = 8.0 if method == "full" else 8.0 + (1 - value if value <= 1 else 256 / value)
    rows = [{"dataset": "pg19", "metric": "ppl", "value": base + 0.5, "n": 2, "tokens": 2000}]
    for k in (500, 1000, 1500, 2000):
        rows.append({"dataset": "pg19", "metric": f"ppl_window@{k}", "value": base + k / 2000, "n": 2, "tokens": 1000})
    return rows


def efficiency_predictions(method) -> pd.DataFrame:
    rows = []
    for n in (1024, 2048):
        for system in ("method", "full", "bare"):
            scale = 0.5 if (system == "method" and method != "full") else 1.0
            rows.append({"sample_id": f"len{n}-bs1-{system}-0", "dataset": f"len{n}_bs1", "system": system,
                         "ttft_seconds": n * 1e-4, "tpot_seconds": scale * n * 1e-5, "peak_memory_bytes": scale * n * 2**20,
                         "throughput_tokens_per_second": 100.0 / scale})
    return pd.DataFrame(rows)


def write(root: Path, method, kind, value, params, task, predictions, metric_rows) -> str:
    """Publish one run; returns its run id."""
    config = {"model": MODEL, "method": method, "kind": kind, "value": value, "task": task, **params}
    rid = store.run_id(config)
    budget = label(kind, value)
    run = {"run_id": rid, "model": MODEL, "method": method, "budget": budget, "budget_kind": kind,
           "budget_value": float(value), "task": task, **{f"method.{k}": v for k, v in params.items()},
           "seed": 42, "position_mode": "original", "kept_fraction": 1.0 if method == "full" else 0.2,
           "tpot_seconds": 0.02, "peak_memory_bytes": 2**30}
    predictions = predictions.copy()
    predictions.insert(0, "run_id", rid)
    metrics = pd.DataFrame([{**run, **row} for row in metric_rows])
    store.write_run(root, rid, "{}", predictions, metrics, {"run_id": rid})
    return rid


def make_results(root: Path) -> Path:
    rng = np.random.default_rng(7)
    longbench, generic, efficiency = LongBench(datasets=list(LONGBENCH), source="sample"), Task(), Efficiency()
    for method, kind, value, params in RUNS:
        budget = label(kind, value)
        preds = longbench_predictions(method, budget, kind, value, rng)
        write(root, method, kind, value, params, "longbench", preds, longbench.aggregate(preds))
        preds = passkey_predictions(method, kind, value)
        write(root, method, kind, value, params, "passkey", preds, generic.aggregate(preds))
        if kind == "tokens":
            preds = pd.DataFrame([{"sample_id": "doc0", "dataset": "pg19", "nll_sum": 1.0, "n_tokens": 1}])
            write(root, method, kind, value, params, "pg19", preds, pg19_metrics(method, value))
            preds = efficiency_predictions(method)
            write(root, method, kind, value, params, "efficiency", preds, efficiency.aggregate(preds))
    return root
