"""One finished run -> one W&B run: resolved config, metric rows (as summary values and a table) and a
table of per-sample predictions. ``logger.mode=offline`` writes ``<dir>/wandb/offline-run-*`` that
``wandb sync`` uploads later. A Hydra multirun is one W&B group."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pandas as pd

from kvbench.errors import ConfigError, unknown_name
from kvbench.store import run_label

MODES = ("offline", "online", "disabled")
# Run-level columns of every metric row that are worth a summary value of their own.
RUN_SUMMARY = ("kept_fraction", "kept_mean", "ttft_seconds", "tpot_seconds", "peak_memory_bytes", "wall_seconds")


def metric_key(row: dict) -> str:
    """``dataset/metric`` (plus ``/bucket`` for LongBench-E length buckets): the W&B summary key of a row."""
    parts = [str(row["dataset"]), str(row["metric"])]
    bucket = row.get("length_bucket")
    if isinstance(bucket, str) and bucket != "all":
        parts.append(bucket)
    return "/".join(parts)


def metric_values(metrics: pd.DataFrame) -> dict[str, float]:
    """Flat ``{key: value}`` of one run's metric rows and its run-level measurements (``run/<column>``)."""
    out = {metric_key(row): float(row["value"]) for row in metrics.to_dict("records")}
    first = metrics.iloc[0] if len(metrics) else {}
    for column in RUN_SUMMARY:
        if column in metrics and not _missing(first[column]):
            out[f"run/{column}"] = float(first[column])
    return out


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _cell(value):
    """A W&B table cell: scalars stay, lists/arrays/dicts become JSON text."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=str)
    return value


def to_table(frame: pd.DataFrame, limit: int | None = None):
    import wandb

    frame = frame if limit is None else frame.head(limit)
    columns = [str(c) for c in frame.columns]
    return wandb.Table(columns=columns, data=[[_cell(v) for v in row] for row in frame.itertuples(index=False)])


def sweep_group() -> str | None:
    """``sweep-<date>-<time>`` from the Hydra sweep dir when running under ``-m``; None otherwise."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
    except ImportError:
        return None
    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    sweep_dir = Path(hydra_cfg.sweep.dir)
    return f"sweep-{sweep_dir.parent.name}-{sweep_dir.name}"


def run_name(metrics: pd.DataFrame) -> str | None:
    """``model / method / budget / task`` from the run's metric rows, as kvbench names runs everywhere (None
    lets W&B pick a name)."""
    if metrics.empty or not {"model", "method", "budget", "task"} <= set(metrics.columns):
        return None
    return run_label(metrics.iloc[0].to_dict())


def check_config(logger_cfg) -> None:
    mode = logger_cfg.get("mode", "offline")
    if mode not in MODES:
        raise unknown_name("logger.mode", mode, MODES)
    limit = logger_cfg.get("max_prediction_rows")
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise ConfigError(f"logger.max_prediction_rows={limit} must be an integer >= 0 (or null for all rows)")
    if mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logger=wandb needs the wandb package, which is not installed (pip install wandb); "
                          "logger=none runs without it")


def log_to_wandb(logger_cfg, config: dict, metrics: pd.DataFrame, predictions: pd.DataFrame, run_dir: Path) -> bool:
    """Log one finished run (``run_dir`` = its store directory) to W&B as configured by ``logger_cfg``;
    False when ``logger.mode=disabled`` logged nothing."""
    check_config(logger_cfg)
    mode = logger_cfg.get("mode", "offline")
    if mode == "disabled":
        return False
    import wandb

    directory = Path(logger_cfg.get("dir") or Path(run_dir).parent.parent)
    directory.mkdir(parents=True, exist_ok=True)
    run_id = Path(run_dir).name
    tags = [str(t) for t in (logger_cfg.get("tags") or [])]
    limit = logger_cfg.get("max_prediction_rows")
    run = wandb.init(
        mode=mode, project=logger_cfg.get("project") or "kvbench", entity=logger_cfg.get("entity"),
        group=logger_cfg.get("group") or sweep_group(), tags=tags, dir=str(directory), name=run_name(metrics),
        job_type=str(metrics["task"].iloc[0]) if "task" in metrics and len(metrics) else None,
        config={**config, "run_id": run_id, "run_dir": str(run_dir)},  # the parquet rows' run_id
        settings=wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True,
                                save_code=False),
        reinit="create_new",
    )
    try:
        values = metric_values(metrics)
        run.log({**values, "metrics": to_table(metrics), "predictions": to_table(predictions, limit)})
        run.summary.update(values)
    finally:
        run.finish()
    return True
