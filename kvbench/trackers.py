"""Experiment trackers a finished run is reported to (``conf/logger/*.yaml``). The parquet store is the
source of truth; trackers get a copy."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvbench.errors import unknown_name

TRACKERS = ("none", "wandb")


def log_run(logger_cfg, config: dict, metrics: pd.DataFrame, predictions: pd.DataFrame, run_dir: Path) -> None:
    """Send one finished run to the configured tracker."""
    name = logger_cfg.name
    if name not in TRACKERS:
        raise unknown_name("logger", name, TRACKERS)
    if name == "wandb":
        from kvbench.wandb_tracker import log_to_wandb

        log_to_wandb(logger_cfg, config, metrics, predictions, run_dir)
