"""Experiment trackers a finished run is reported to (``conf/logger/*.yaml``). The parquet store is the
source of truth; trackers get a copy. ``<root>/logged/<tracker>/<run_id>`` records that a run was sent, so
that a run finished without a tracker is sent when it is asked for later (a re-run that skips the finished
run) and a run is never sent twice."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from kvbench.errors import unknown_name

TRACKERS = ("none", "wandb")
log = logging.getLogger("kvbench")


def check(logger_cfg) -> None:
    """One-line errors for a bad tracker config, before the run (not after it has finished)."""
    if logger_cfg.name not in TRACKERS:
        raise unknown_name("logger", logger_cfg.name, TRACKERS)
    if logger_cfg.name == "wandb":
        from kvbench.wandb_tracker import check_config

        check_config(logger_cfg)


def _logged_marker(run_dir: Path, tracker: str) -> Path:
    run_dir = Path(run_dir)
    return run_dir.parent.parent / "logged" / tracker / run_dir.name


def log_run(logger_cfg, config: dict, metrics: pd.DataFrame, predictions: pd.DataFrame, run_dir: Path) -> None:
    """Send one finished run (``run_dir``: its store directory) to the configured tracker."""
    check(logger_cfg)
    if logger_cfg.name == "wandb":
        from kvbench.wandb_tracker import log_to_wandb

        if log_to_wandb(logger_cfg, config, metrics, predictions, run_dir):
            marker = _logged_marker(run_dir, "wandb")
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()


def log_finished(logger_cfg, run_dir: Path) -> None:
    """A run skipped because it had finished: send it to the tracker unless it was sent before."""
    if logger_cfg.name == "none":
        return
    if _logged_marker(run_dir, logger_cfg.name).exists():
        log.info("run %s was logged to %s before: not logged again", Path(run_dir).name, logger_cfg.name)
        return
    log.info("run %s finished without %s: logging its stored results now", Path(run_dir).name, logger_cfg.name)
    config = OmegaConf.to_container(OmegaConf.load(Path(run_dir) / "config.yaml"), resolve=True)
    log_run(logger_cfg, config, pd.read_parquet(Path(run_dir) / "metrics.parquet"),
            pd.read_parquet(Path(run_dir) / "predictions.parquet"), run_dir)
