"""One run: model x method x budget x task -> predictions and metrics in the results store."""

from __future__ import annotations

import datetime as dt
import hashlib
import itertools
import os
import logging
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import kvbench
from kvbench import checks, models, status, store, trackers
from kvbench.budget import Budget
from kvbench.compile import compile_enabled
from kvbench.engine import Engine, peak_memory_bytes
from kvbench.errors import ConfigError, describe, disk_full, disk_full_line
from kvbench.kernels import dispatch
from kvbench.methods.base import Method
from kvbench.tasks.base import Task

log = logging.getLogger("kvbench")

# Config keys whose values change a result; everything under them goes into the run id and the row.
RESULT_KEYS = ("model", "method", "budget", "task", "seed", "batch_size", "position_mode", "limit", "engine")
FULL = "full"  # the full cache keeps every token: its result does not depend on the budget


def result_config(cfg: DictConfig) -> dict:
    """The resolved values that change a result (the run id hashes them). The full cache's budget is left
    out, so a budget sweep runs it once."""
    config = {k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
              for k in RESULT_KEYS}
    engine, device = config["engine"], torch.device(str(cfg.model.device))
    if engine.get("cuda_graphs") == "auto":  # recorded resolved: the same run as the explicit value
        engine["cuda_graphs"] = device.type == "cuda"
    if "compile" in engine:  # resolved too; off is left out, so runs made before the switch existed keep their id
        if compile_enabled(engine.pop("compile"), device, engine["cuda_graphs"]):
            engine["compile"] = True
    if method_name(cfg) == FULL:
        config["budget"] = None
    return config


def method_name(cfg: DictConfig) -> str:
    return get_class(cfg.method._target_).name


def run_labels(cfg: DictConfig) -> dict:
    """model, method, budget and task as every row, status record and log names them."""
    budget = FULL if method_name(cfg) == FULL else Budget(cfg.budget.kind, cfg.budget.value).label
    return {"model": cfg.model.name, "method": method_name(cfg), "budget": budget,
            "task": get_class(cfg.task._target_).name}


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


def build(cfg: DictConfig) -> tuple[models.LanguageModel, Method, Budget, Task]:
    method, budget = build_method(cfg)
    task = build_task(cfg)
    return models.load(cfg.model), method, budget, task


def build_method(cfg: DictConfig) -> tuple[Method, Budget]:
    method = checks.instantiate_config(cfg.method)
    if not isinstance(method, Method):
        raise ConfigError(f"method config '{cfg.method.get('_target_')}' does not build a kvbench Method")
    return method, Budget(kind=cfg.budget.kind, value=cfg.budget.value)


def build_task(cfg: DictConfig) -> Task:
    task = checks.instantiate_config(cfg.task)
    if not isinstance(task, Task):
        raise ConfigError(f"task config '{cfg.task.get('_target_')}' does not build a kvbench Task")
    return task


def build_engine(cfg: DictConfig, lm: models.LanguageModel, method: Method, budget: Budget) -> Engine:
    return Engine(lm.model, method, budget, cfg.model.attn_implementation, cfg.position_mode,
                  prefill_chunk_size=cfg.engine.prefill_chunk_size, cuda_graphs=cfg.engine.cuda_graphs,
                  batch_size=cfg.batch_size, compile=cfg.engine.compile)


def device_id(device: torch.device) -> str:
    """What runs share when they compete: the host's cores, or one physical GPU (its UUID, the same under
    any CUDA_VISIBLE_DEVICES numbering)."""
    if device.type != "cuda":
        return device.type
    return f"cuda:{torch.cuda.get_device_properties(device.index or 0).uuid}"


@dataclass
class Point:
    """One run while it executes: its config, results root, id and labels, its Hydra job dir (or None), and
    its status record ("running": start in epoch seconds, the device it competes for (``device_id``), labels,
    the command-line overrides it was started with when known)."""

    cfg: DictConfig
    root: Path
    rid: str
    labels: dict
    hydra_dir: Path | None
    record: dict


def run(cfg: DictConfig, hydra_dir: Path | None = None, overrides: list[str] | None = None) -> Path | None:
    """Execute one run; returns the run directory, or None when it was already finished and skipped (then it
    is sent to the configured tracker if it never was, and the collected tables are rebuilt if a full disk
    left them stale). ``skip_finished=false`` runs it again and replaces the published run (the old one is
    kept as ``runs/<run_id>.prev``); so does a published run that does not read back. ``overrides``: the
    command-line overrides it was started with, recorded so that ``kvbench status`` can say how to re-run it.

    While it runs, ``<root>/status/<run_id>.json`` says so; if it fails or is interrupted, the record says
    that (with the error); a published run replaces it."""
    point = open_point(cfg, hydra_dir, overrides)
    return None if point is None else execute(point)


def open_point(cfg: DictConfig, hydra_dir: Path | None, overrides: list[str] | None = None) -> Point | None:
    """Check a run and mark it running; None when it finished before (skipped, as ``run`` says)."""
    checks.validate(cfg)
    root = Path(cfg.results_root)
    rid = store.run_id(result_config(cfg))
    if cfg.skip_finished and store.is_finished(root, rid):
        log.info("run %s already finished in %s: skipped", rid, store.run_dir(root, rid))
        store.update_tables(root, only_if_stale=True)  # a full disk may have left them stale
        trackers.log_finished(cfg.logger, store.run_dir(root, rid))
        return None
    published = store.run_dir(root, rid)
    damage = store.unreadable(published) if (published / store.FINISHED_MARKER).exists() else None
    if damage:
        log.warning("run %s does not read back (%s): running it again; the unreadable copy is kept as %s%s",
                    rid, damage, published, store.PREVIOUS)
    labels = run_labels(cfg)
    record = {"start": time.time(), "device_id": device_id(torch.device(cfg.model.device)), **labels,
              **({"overrides": list(overrides)} if overrides is not None else {})}
    status.mark(root, rid, "running", **record)
    return Point(cfg, root, rid, labels, hydra_dir, record)


def execute(point: Point) -> Path:
    """Run an opened point alone and publish it; a failure or Ctrl-C is recorded in its status record."""
    try:
        written = _execute(point)
    except BaseException as err:
        with status.sigint_held():  # a local sweep's Ctrl-C reaches a run twice (terminal, job controller)
            mark_ended(point, err)
        raise
    return announce(point, *written)


def announce(point: Point, final: Path, metrics: pd.DataFrame, predictions: pd.DataFrame) -> Path:
    """A published run logged and sent to the configured tracker; returns its run directory."""
    log.info("run %s written to %s", point.rid, final)
    trackers.log_run(point.cfg.logger, OmegaConf.to_container(point.cfg, resolve=True), metrics, predictions, final)
    return final


def mark_ended(point: Point, err: BaseException) -> None:
    """The status record of a run that ended unpublished: "interrupted" (Ctrl-C) or "failed" with the error.
    Writing it may fail too (a full disk): then the "running" record stays and shows as stale."""
    if isinstance(err, KeyboardInterrupt):
        state, error = "interrupted", "interrupted (Ctrl-C or SIGINT) before it was published"
    else:
        full = disk_full(err)
        state, error = "failed", disk_full_line(full, point.root) if full else f"{type(err).__name__}: {err}"
    try:
        status.mark(point.root, point.rid, state, error=error, **point.record)
    except OSError as mark_err:
        log.warning("run %s %s, and its status record could not be written (%s)", point.rid, state,
                    describe(mark_err))


def prepare(cfg: DictConfig) -> None:
    """The process settings a run needs before it builds anything: threads, seeds, the kernel backend."""
    if os.environ.get("SLURM_CPUS_PER_TASK"):  # one thread per granted core: oversubscribed cores crawl
        torch.set_num_threads(int(os.environ["SLURM_CPUS_PER_TASK"]))
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    dispatch.set_backend(cfg.kernels.backend)


def load_samples(cfg: DictConfig, task: Task, lm: models.LanguageModel) -> list:
    """The run's samples (the first ``limit``), each checked to fit the model."""
    samples = checks.task_samples(task)
    if cfg.limit is not None:
        samples = samples[: int(cfg.limit)]
    for sample in samples:
        task.check_fits(task.build_prompt(sample, lm), sample, lm, cfg.position_mode)
    return samples


def progress_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    transient=False)


def _execute(point: Point) -> tuple[Path, pd.DataFrame, pd.DataFrame]:
    """The run up to its publication: (run directory, metric rows, per-sample rows)."""
    cfg = point.cfg
    prepare(cfg)
    lm, method, budget, task = build(cfg)
    engine = build_engine(cfg, lm, method, budget)
    samples = load_samples(cfg, task, lm)
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
    rows: list[dict] = []
    t0 = time.perf_counter()
    with progress_bar() as progress:
        bar = progress.add_task(store.run_label(point.labels), total=len(samples))
        # a task that runs a batch in lockstep gets batch_size samples at a time; the others get them all and
        # decode them through the engine's continuous batching, the bar following each finished generation
        chunk = cfg.batch_size if task.lockstep_batches else len(samples)
        finished = itertools.count(1)
        engine.on_generation = lambda: progress.update(bar, completed=min(len(samples), next(finished)))
        for start in range(0, len(samples), chunk):
            batch = samples[start : start + chunk]
            rows.extend(task.predict(batch, lm, engine))
            progress.update(bar, completed=start + len(batch))
    return publish(point, task, rows, time.perf_counter() - t0, len(samples), engine)


def publish(point: Point, task: Task, rows: list[dict], wall: float, n_samples: int, engine: Engine,
            group: list[str] = ()) -> tuple[Path, pd.DataFrame, pd.DataFrame]:
    """Score a run's per-sample rows and write it, as if it had run alone: (run directory, metric rows,
    per-sample rows). ``engine``: the run's (one of a fused group's). ``group``: the run ids of a fused group it
    ran in (``kvbench.sweep``; this one included): its timings were shared with them, so its rows say
    ``fused_group_size`` and the group's runs do not count as other runs on the device; the group rebuilds the
    collected tables once, after its last publication, instead of once per run."""
    cfg, root, rid, labels = point.cfg, point.root, point.rid, point.labels
    budget, device = Budget(cfg.budget.kind, cfg.budget.value), engine.device
    group_size = max(1, len(group))
    predictions = pd.DataFrame(rows)
    predictions.insert(0, "run_id", rid)
    predictions["fused_group_size"] = group_size
    started = dt.datetime.fromtimestamp(point.record["start"], dt.timezone.utc)
    overlapping = [r for r in status.overlapping_runs(root, rid, point.record["device_id"], point.record["start"],
                                                      time.time()) if r not in group]
    if overlapping:
        log.warning("run %s shared its device with %d other runs (%s): its timings are marked "
                    "concurrent_runs=%d", rid, len(overlapping), ", ".join(overlapping), len(overlapping))
    code = kvbench.code_version()
    config = result_config(cfg)
    run_columns = {
        "run_id": rid,
        **labels,
        "budget_kind": FULL if labels["budget"] == FULL else budget.kind,
        "budget_value": float("nan") if labels["budget"] == FULL else budget.value,
        **_flatten("method", {k: v for k, v in config["method"].items()}),
        **_flatten("task", config["task"]),
        **_flatten("engine", config["engine"]),
        "engine.compile": engine.compile_decode,  # what auto resolved to on this device
        "seed": cfg.seed,
        "batch_size": cfg.batch_size,
        "position_mode": cfg.position_mode,
        "limit": cfg.limit,
        "n_samples": n_samples,
        "attn_implementation": cfg.model.attn_implementation,
        "dtype": cfg.model.dtype,
        "device": str(device),
        "concurrent_runs": len(overlapping),  # > 0: timings taken while other runs shared the device
        "fused_group_size": group_size,  # > 1: prompt passes and timings shared by a fused sweep group
        **code,
    }
    metric_rows = task.aggregate(predictions)
    summary = _summary(predictions, wall, peak_memory_bytes(device))
    metrics = pd.DataFrame([{**run_columns, **row, "sample_ids_hash": sample_ids_hash(predictions, row["dataset"]),
                             **summary} for row in metric_rows])
    meta = _meta(cfg, labels, rid, str(device), point.record["device_id"], started, n_samples, overlapping, code)
    if "overrides" in point.record:
        meta["overrides"] = point.record["overrides"]
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    final = store.write_run(root, rid, config_yaml, predictions, metrics, meta, copy_to=point.hydra_dir,
                            artifacts=task.artifacts(predictions), replace=not cfg.skip_finished,
                            tables=not group)
    status.clear(root, rid)
    return final, metrics, predictions


def _meta(cfg: DictConfig, labels: dict, rid: str, device: str, device_key: str, started: dt.datetime,
          n_samples: int, overlapping: list[str], code: dict) -> dict:
    """meta.json: what ran where and when (versions, device, host, SLURM job, start and end)."""
    return {
        **code,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "python": platform.python_version(),
        "attn_implementation": cfg.model.attn_implementation,
        "dtype": cfg.model.dtype,
        "device": device,
        "device_id": device_key,
        "kernels_backend": cfg.kernels.backend,
        "kernels_ran": dict(dispatch.ran),
        "seed": cfg.seed,
        "hostname": platform.node(),
        **status.slurm_job(),
        "start": started.isoformat(),
        "end": dt.datetime.now(dt.timezone.utc).isoformat(),
        "run_id": rid,
        **labels,
        "n_samples": n_samples,
        "concurrent_run_ids": overlapping,
    }


def sample_ids_hash(predictions: pd.DataFrame, dataset: str) -> str:
    """16-hex hash of the sorted sample ids behind one metric row (its dataset's samples; every sample for
    rows that average over datasets): rows with equal hashes were scored on the same samples."""
    rows = predictions[predictions["dataset"] == dataset] if (predictions["dataset"] == dataset).any() else predictions
    ids = sorted(set(rows["sample_id"].astype(str)))
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]


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
    "batch_size_realized": ("decode_batch_size", "max"),  # batch_size=auto: the slots it chose
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
