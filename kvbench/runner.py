"""One run: model x method x budget x task -> predictions and metrics in the results store."""

from __future__ import annotations

import datetime as dt
import os
import logging
import platform
import random
import subprocess
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import kvbench
from kvbench import models, store, trackers
from kvbench.budget import Budget
from kvbench.engine import Engine, peak_memory_bytes
from kvbench.errors import ConfigError
from kvbench.kernels import dispatch
from kvbench.methods.base import Method
from kvbench.tasks.base import Task

log = logging.getLogger("kvbench")

# Config keys whose values change a result; everything under them goes into the run id and the row.
RESULT_KEYS = ("model", "method", "budget", "task", "seed", "batch_size", "position_mode", "limit", "engine")


def result_config(cfg: DictConfig) -> dict:
    resolved = OmegaConf.to_container(cfg, resolve=True)
    return {k: resolved.get(k) for k in RESULT_KEYS}


def _flatten(prefix: str, node: dict) -> dict:
    out = {}
    for key, value in node.items():
        if key == "_target_":
            continue
        name = f"{prefix}.{key}"
        if isinstance(value, dict):
            out.update(_flatten(name, value))
        else:
            out[name] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    return out


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(kvbench.__file__).parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _instantiate(node):
    """hydra's instantiate, with a ConfigError raised by the target's validation passed through unwrapped
    (Hydra wraps it in a multi-line InstantiationException)."""
    try:
        return instantiate(node)
    except InstantiationException as err:
        cause = err.__cause__ or err.__context__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise


def build(cfg: DictConfig) -> tuple[models.LanguageModel, Method, Budget, Task]:
    method = _instantiate(cfg.method)
    if not isinstance(method, Method):
        raise ConfigError(f"method config '{cfg.method.get('_target_')}' does not build a kvbench Method")
    budget = Budget(kind=cfg.budget.kind, value=cfg.budget.value)
    task = _instantiate(cfg.task)
    if not isinstance(task, Task):
        raise ConfigError(f"task config '{cfg.task.get('_target_')}' does not build a kvbench Task")
    lm = models.load(cfg.model)
    return lm, method, budget, task


def run(cfg: DictConfig, hydra_dir: Path | None = None) -> Path | None:
    """Execute one run; returns the run directory, or None when it was already finished and skipped.

    While it runs, ``<root>/status/<run_id>.json`` says so; if it fails, the record holds the error
    (``kvbench status`` shows both); a finished run replaces it."""
    root = Path(cfg.results_root)
    config = result_config(cfg)
    rid = store.run_id(config)
    if cfg.skip_finished and store.is_finished(root, rid):
        log.info("run %s already finished in %s: skipped", rid, store.run_dir(root, rid))
        return None
    labels = {"model": cfg.model.name, "method": cfg.method._target_.rsplit(".", 1)[-1],
              "budget": f"{cfg.budget.kind}:{cfg.budget.value}", "task": cfg.task._target_.rsplit(".", 1)[-1]}
    store.mark(root, rid, "running", **labels)
    try:
        return _execute(cfg, root, config, rid, hydra_dir)
    except BaseException as err:
        store.mark(root, rid, "failed", error=f"{type(err).__name__}: {err}", **labels)
        raise


def _execute(cfg: DictConfig, root: Path, config: dict, rid: str, hydra_dir: Path | None) -> Path:
    if cfg.batch_size < 1:
        raise ConfigError(f"batch_size={cfg.batch_size} must be >= 1")
    if os.environ.get("SLURM_CPUS_PER_TASK"):  # one thread per granted core: oversubscribed cores crawl
        torch.set_num_threads(int(os.environ["SLURM_CPUS_PER_TASK"]))
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    started = dt.datetime.now(dt.timezone.utc)
    dispatch.set_backend(cfg.kernels.backend)
    lm, method, budget, task = build(cfg)
    engine = Engine(lm.model, method, budget, cfg.model.attn_implementation, cfg.position_mode,
                    prefill_chunk_size=cfg.engine.prefill_chunk_size, cuda_graphs=cfg.engine.cuda_graphs)
    samples = task.samples()
    if cfg.limit is not None:
        samples = samples[: int(cfg.limit)]
    if not samples:
        raise ConfigError(f"task '{task.name}' produced no samples")
    for sample in samples:
        task.check_fits(task.build_prompt(sample, lm), sample, lm, cfg.position_mode)
    device = engine.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rows: list[dict] = []
    t0 = time.perf_counter()
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, transient=False) as progress:
        bar = progress.add_task(f"{method.name}@{budget.label} {task.name}", total=len(samples))
        for start in range(0, len(samples), cfg.batch_size):
            batch = samples[start : start + cfg.batch_size]
            rows.extend(task.predict(batch, lm, engine))
            progress.advance(bar, len(batch))
    wall = time.perf_counter() - t0
    predictions = pd.DataFrame(rows)
    predictions.insert(0, "run_id", rid)
    run_columns = {
        "run_id": rid,
        "model": lm.name,
        "method": method.name,
        "budget": budget.label,
        "budget_kind": budget.kind,
        "budget_value": budget.value,
        "task": task.name,
        **_flatten("method", {k: v for k, v in config["method"].items()}),
        **_flatten("task", config["task"]),
        **_flatten("engine", config["engine"]),
        "seed": cfg.seed,
        "batch_size": cfg.batch_size,
        "position_mode": cfg.position_mode,
        "attn_implementation": cfg.model.attn_implementation,
        "dtype": cfg.model.dtype,
    }
    metric_rows = task.aggregate(predictions)
    summary = _summary(predictions, wall, peak_memory_bytes(device))
    metrics = pd.DataFrame([{**run_columns, **row, **summary} for row in metric_rows])
    meta = {
        "kvbench_version": kvbench.__version__,
        "git_commit": _git_commit(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "python": platform.python_version(),
        "attn_implementation": cfg.model.attn_implementation,
        "dtype": cfg.model.dtype,
        "device": str(device),
        "kernels_backend": cfg.kernels.backend,
        "kernels_ran": dict(dispatch.ran),
        "seed": cfg.seed,
        "hostname": platform.node(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "start": started.isoformat(),
        "end": dt.datetime.now(dt.timezone.utc).isoformat(),
        "run_id": rid,
        "model": lm.name,
        "method": method.name,
        "budget": budget.label,
        "task": task.name,
        "n_samples": len(samples),
    }
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    final = store.write_run(root, rid, config_yaml, predictions, metrics, meta, copy_to=hydra_dir,
                            artifacts=task.artifacts(predictions))
    log.info("run %s written to %s", rid, final)
    trackers.log_run(cfg.logger, OmegaConf.to_container(cfg, resolve=True), metrics, predictions, final)
    return final


# run-level column -> (per-sample column, how the run value is made from it)
SUMMARY_COLUMNS = {
    "kept_mean": ("kept_mean", "mean"),
    "n_keep_mean": ("n_keep", "mean"),
    "kv_bytes_full": ("kv_bytes_full", "mean"),
    "kv_bytes_compressed": ("kv_bytes_compressed", "mean"),
    "kv_bytes_final": ("kv_bytes_final", "mean"),
    "ttft_seconds": ("prefill_seconds", "mean"),
    "tpot_seconds": ("tpot_seconds", "mean"),
    "compress_seconds": ("compress_seconds", "mean"),
    "decode_compress_seconds": ("decode_compress_seconds", "mean"),
    "output_tokens_mean": ("output_tokens", "mean"),
    "peak_memory_bytes": ("peak_memory_bytes", "max"),
    "peak_memory_above_weights_bytes": ("peak_memory_above_weights_bytes", "max"),
    "decode_kv_bytes_mean": ("decode_kv_bytes_mean", "mean"),
}


def _summary(predictions: pd.DataFrame, wall: float, peak: int) -> dict:
    """Run-level efficiency and realized-budget columns that sit beside every metric row.

    Tasks that are not generation (perplexity) may lack some per-sample columns; those stay NaN. Rows of
    reference systems timed beside the method (the efficiency task's ``system`` column) are left out."""
    if "system" in predictions:
        predictions = predictions[predictions["system"] == "method"]
    out = {"wall_seconds": wall, "process_peak_memory_bytes": peak}
    for name, (column, how) in SUMMARY_COLUMNS.items():
        values = predictions[column] if column in predictions else pd.Series(dtype=float)
        out[name] = float(getattr(values, how)()) if len(values) else float("nan")
    if "kept_mean" in predictions and "prompt_length" in predictions:
        out["kept_fraction"] = float((predictions["kept_mean"] / predictions["prompt_length"]).mean())
    else:
        out["kept_fraction"] = float("nan")
    return out
