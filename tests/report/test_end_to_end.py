"""A real multirun sweep (tiny random model, logged to W&B offline) followed by ``python -m kvbench.report``."""

from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd
import pytest

from tests.report.wandb_records import decode_run, needs_wandb

pytestmark = pytest.mark.slow


def run(args, cwd):
    env = {**os.environ, "WANDB_SILENT": "true"}
    done = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@needs_wandb
def test_sweep_then_report(tmp_path):
    root = tmp_path / "results"
    run(["-m", "kvbench", "-m", "model=tiny-llama-random", "method=full,streamingllm", "budget=0.2,0.5",
         "task=passkey", "task.context_lengths=[128]", "task.depths=[0,100]", "logger=wandb",
         f"results_root={root}"], tmp_path)
    run(["-m", "kvbench.report", "--root", str(root), "--ci", "--pvalues"], tmp_path)
    metrics = pd.read_parquet(root / "metrics.parquet")
    assert metrics["run_id"].nunique() == 3  # the full cache runs once for both budgets
    table = pd.read_csv(root / "report" / "tables" / "passkey.csv").set_index(["budget", "method"])
    exact = metrics[metrics.metric == "exact_match"]
    for r in exact.itertuples():
        budget = "full" if r.method == "full" else r.budget
        assert table.at[(budget, r.method), "passkey"] == pytest.approx(r.value)
    assert sorted(table.index) == [("0.2", "streamingllm"), ("0.5", "streamingllm"), ("full", "full")]
    for name in ("passkey.md", "passkey.tex", "passkey_pvalues.csv"):
        assert (root / "report" / "tables" / name).exists()
    for kind in ("needle", "budget", "efficiency"):
        assert list((root / "report" / "plots").glob(f"{kind}_passkey_*.png")), kind
    # the full cache and StreamingLLM keep the same fraction in every layer and head: no one-colour heatmap
    assert not list((root / "report" / "plots").glob("kept_passkey_*.png"))
    # every run is in W&B (offline), all three in the sweep's group, with the metric values of the parquet
    runs = [decode_run(f) for f in root.glob("wandb/offline-run-*/run-*.wandb")]
    assert len(runs) == 3
    assert len({r["group"] for r in runs}) == 1 and runs[0]["group"].startswith("sweep-")
    for r in runs:
        rid = r["config"]["run_id"]
        row = exact[exact.run_id == rid].iloc[0]
        assert r["summary"]["passkey/exact_match"] == pytest.approx(row.value)
        assert r["summary"]["run/kept_fraction"] == pytest.approx(row.kept_fraction)
