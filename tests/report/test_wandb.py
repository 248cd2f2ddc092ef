"""The W&B tracker writes an offline run whose record log holds the metrics, config, group and tags."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from kvbench import trackers
from kvbench.errors import ConfigError
from kvbench.wandb_tracker import log_to_wandb, metric_key, sweep_group
from tests.report.wandb_records import decode_run, needs_wandb

CONF = Path(__file__).resolve().parents[2] / "conf" / "logger" / "wandb.yaml"


def logger(tmp_path, **overrides):
    cfg = OmegaConf.load(CONF)
    cfg.dir = str(tmp_path)
    for key, value in overrides.items():
        cfg[key] = value
    return cfg


def run_frames():
    run = {"run_id": "abc123", "model": "tiny", "method": "h2o", "budget": "0.2", "task": "longbench",
           "kept_fraction": 0.21, "tpot_seconds": 0.015}
    metrics = pd.DataFrame([
        {**run, "dataset": "qasper", "metric": "score", "value": 31.25, "length_bucket": "all"},
        {**run, "dataset": "qasper", "metric": "score", "value": 12.5, "length_bucket": "4-8k"},
        {**run, "dataset": "avg:overall", "metric": "score", "value": 31.25, "length_bucket": "all"},
    ])
    predictions = pd.DataFrame({"run_id": ["abc123"] * 2, "sample_id": ["a", "b"], "dataset": ["qasper"] * 2,
                                "metric.score": [0.5, 0.125], "kept_per_layer_head": [[[3, 4]], [[5, 6]]]})
    return metrics, predictions


def settled_run(path: Path, key: str = "qasper/score", timeout: float = 60.0) -> dict:
    """The decoded run once W&B's background writer has flushed the summary (it can lag ``finish`` under load)."""
    deadline = time.monotonic() + timeout
    run = decode_run(path)
    while key not in run["summary"] and time.monotonic() < deadline:
        time.sleep(0.5)
        run = decode_run(path)
    return run


def test_defaults_are_offline_with_results_root_dir():
    cfg = OmegaConf.load(CONF)
    assert cfg.name == "wandb" and cfg.mode == "offline" and cfg.project == "kvbench" and cfg.group is None


@needs_wandb
def test_offline_run_holds_metrics_config_group_and_tags(tmp_path):
    metrics, predictions = run_frames()
    run_dir = tmp_path / "runs" / "abc123"
    log_to_wandb(logger(tmp_path, group="sweep-x", tags=["ci", "h2o"]), {"seed": 42, "model": {"name": "tiny"}},
                 metrics, predictions, run_dir)
    files = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1
    run = settled_run(files[0])
    assert run["summary"]["qasper/score"] == 31.25
    assert run["summary"]["qasper/score/4-8k"] == 12.5
    assert run["summary"]["avg:overall/score"] == 31.25
    assert run["summary"]["run/kept_fraction"] == pytest.approx(0.21)
    assert run["summary"]["predictions/nrows"] == 2 and run["summary"]["metrics/nrows"] == 3
    assert run["config"]["seed"] == 42 and run["config"]["run_id"] == "abc123"
    assert run["group"] == "sweep-x" and sorted(run["tags"]) == ["ci", "h2o"]
    assert run["project"] == "kvbench" and run["name"] == "tiny / h2o / 0.2 / longbench"


def test_disabled_writes_nothing_and_bad_mode_is_rejected(tmp_path):
    metrics, predictions = run_frames()
    log_to_wandb(logger(tmp_path, mode="disabled"), {}, metrics, predictions, tmp_path / "runs" / "r")
    assert not (tmp_path / "wandb").exists()
    with pytest.raises(ConfigError, match="'sync'.*offline, online"):
        log_to_wandb(logger(tmp_path, mode="sync"), {}, metrics, predictions, tmp_path / "runs" / "r")


def test_without_the_wandb_package_the_run_is_refused_before_it_starts(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ConfigError, match="logger=wandb needs the wandb package.*logger=none"):
        trackers.check(logger(tmp_path))
    trackers.check(logger(tmp_path, mode="disabled"))  # logs nothing: needs nothing


def test_metric_keys_and_no_group_outside_a_hydra_sweep():
    assert metric_key({"dataset": "niah", "metric": "rouge1"}) == "niah/rouge1"
    assert metric_key({"dataset": "qasper", "metric": "score", "length_bucket": "8k+"}) == "qasper/score/8k+"
    assert sweep_group() is None


@needs_wandb
def test_a_run_finished_without_wandb_is_logged_when_asked_later(tmp_path):
    from kvbench import runner
    from tests.test_runner import make_cfg

    run_dir = runner.run(make_cfg(tmp_path, "method=full"))  # logger=none
    assert not (tmp_path / "wandb").exists()
    assert runner.run(make_cfg(tmp_path, "method=full", "logger=wandb")) is None  # skipped, yet logged now
    files = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1
    run = settled_run(files[0], key="passkey/exact_match")
    assert run["config"]["run_id"] == run_dir.name and run["name"] == "tiny-llama-random / full / full / passkey"
    runner.run(make_cfg(tmp_path, "method=full", "logger=wandb"))  # logged before: not a second W&B run
    assert len(list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))) == 1
