"""The runner and the results store: files written, skip-if-finished, atomic publication, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

import kvbench
from kvbench import runner, store
from kvbench.errors import ConfigError

from tests.conftest import CONF, REPO


def make_cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(
            config_name="config",
            overrides=["model=tiny-llama-random", "task=passkey", "task.context_lengths=[128]",
                       "task.depths=[0,100]", f"results_root={tmp_path}", *overrides],
            return_hydra_config=False,
        )


def test_run_writes_self_describing_files_and_collects(tmp_path):
    cfg = make_cfg(tmp_path, "method=full", "budget='0.5'")
    run_dir = runner.run(cfg, hydra_dir=tmp_path / "hydra_out")
    for name in ("config.yaml", "predictions.parquet", "metrics.parquet", "meta.json"):
        assert (run_dir / name).exists() and (tmp_path / "hydra_out" / name).exists()
    preds = pd.read_parquet(run_dir / "predictions.parquet")
    assert len(preds) == 2 and {"prediction", "references", "kept_per_layer_head", "prefill_seconds"} <= set(preds)
    metrics = pd.read_parquet(tmp_path / "metrics.parquet")  # the collected table
    assert set(metrics["metric"]) == {"exact_match", "partial_match"}
    row = metrics.iloc[0]
    # the full cache ignores the budget: its rows say so instead of naming the budget it was started with
    assert (row.method, row.budget, row.budget_kind, row.task, row.n) == ("full", "full", "full", "passkey", 2)
    assert row.kept_fraction == pytest.approx(1.0)
    # the sample set and the code are in every row
    assert (row.limit, row.n_samples) == (None, 2) and len(row.sample_ids_hash) == 16
    assert row.kvbench_version == kvbench.__version__ and row.git_commit == kvbench.code_version()["git_commit"]
    meta = json.loads((run_dir / "meta.json").read_text())
    assert {"git_commit", "torch", "transformers", "attn_implementation", "dtype", "seed", "hostname"} <= set(meta)


def test_finished_run_is_skipped_and_changed_config_is_not(tmp_path):
    cfg = make_cfg(tmp_path, "method=full")
    first = runner.run(cfg)
    stamp = (first / "meta.json").stat().st_mtime_ns
    assert runner.run(cfg) is None
    assert (first / "meta.json").stat().st_mtime_ns == stamp
    other = runner.run(make_cfg(tmp_path, "method=full", "seed=7"))
    assert other is not None and other != first
    assert len(pd.read_parquet(tmp_path / "metrics.parquet")["run_id"].unique()) == 2


def test_interrupted_run_leaves_nothing_that_looks_finished(tmp_path, monkeypatch):
    cfg = make_cfg(tmp_path, "method=full")

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pd.DataFrame, "to_parquet", crash)
    with pytest.raises(KeyboardInterrupt):
        runner.run(cfg)
    monkeypatch.undo()
    assert store.finished_runs(tmp_path) == []
    assert not any(p.name.startswith(".") for p in (tmp_path / "runs").iterdir())  # temp dir cleaned
    assert runner.run(cfg) is not None  # and the re-run is not skipped


def test_context_longer_than_the_model_is_an_error(tmp_path):
    cfg = make_cfg(tmp_path, "method=full", "model.max_length=100")
    with pytest.raises(ConfigError, match=r"needs \d+ tokens .* max_length=100"):
        runner.run(cfg)
    assert store.finished_runs(tmp_path) == []


def test_cli_rejects_unknown_names_in_one_line(tmp_path):
    for args, needle in [(["method=nope"], "unknown method 'nope'; accepted: "),
                         (["-m", "task=passkey,nope"], "unknown task 'nope'; accepted: "),
                         (["budget.value=1.5", "task=passkey"], "budget fraction 1.5 is outside (0, 1]")]:
        proc = subprocess.run(
            [sys.executable, "-m", "kvbench", *args, "model=tiny-llama-random", f"results_root={tmp_path}"],
            capture_output=True, text=True, cwd=REPO, timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        errors = [line for line in proc.stderr.splitlines() if line.startswith("kvbench: error:")]
        assert len(errors) == 1 and needle in errors[0]
    assert store.finished_runs(tmp_path) == []


def test_a_published_run_is_never_replaced_by_a_second_writer(tmp_path):
    """Two jobs finishing the same point (a requeued job and its resubmission): the first stays published."""
    import pandas as pd

    frame = pd.DataFrame({"x": [1]})
    first = store.write_run(tmp_path, "abc", "a: 1", frame, frame, {"writer": 1})
    second = store.write_run(tmp_path, "abc", "a: 1", frame, frame, {"writer": 2})
    assert first == second
    assert store.read_meta(first)["writer"] == 1
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["abc"]  # the loser's temp dir is gone
