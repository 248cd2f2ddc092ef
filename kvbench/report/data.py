"""Collected results -> the rows the report tabulates: filtered, one table row per model x budget x method
variant, full-cache runs of any budget merged into one "full" row per model; optionally re-blocked by the
realized kept fraction instead of the budget label (``align_by_kept``). The collected tables are rebuilt from
``runs/`` first when they do not hold exactly the finished runs, and runs that do not read back are named
with the command that runs them again, as ``kvbench status`` names them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from kvbench import status, store
from kvbench.errors import ConfigError
from kvbench.report.paper import FULL, KEPT

FILTER_COLUMNS = ("model", "task", "budget", "method", "dataset")
# Columns whose differing values make different table rows of one method (besides method.* hyperparameters).
# ``limit`` is not one: runs on other samples are the same row, aligned on the full cache's samples below.
VARIANT_COLUMNS = ("position_mode", "seed", "task.mode", "task.measure", "task.variant", "task.protocol")


@dataclass
class Results:
    metrics: pd.DataFrame  # one row per run x dataset x metric (runner.py columns) + row labels
    predictions: pd.DataFrame  # one row per run x sample (task columns) + row labels
    notes: list[str] = field(default_factory=list)  # what a reader must know of the store: unreadable runs ...


def load(root: Path) -> Results:
    """The collected tables of ``root``, rebuilt first if they are stale (a full disk, a killed writer, a
    truncated table), with notes naming the runs that do not read back and any rebuild."""
    root = Path(root)
    corrupt = [r for r in map(status.published_record, store.published_runs(root)) if r["state"] == "corrupt"]
    notes = [f"run {store.run_dir(root, r['run_id'])} ({store.run_label(r)}) does not read back ({r['error']}): "
             f"it is in no table; {status.what_to_do(root, r)}" for r in corrupt]
    stale = store.stale_tables(root, [r["run_id"] for r in corrupt])
    if stale:
        try:
            store.collect(root)
            notes.append(f"the collected tables were stale ({stale}): rebuilt from {root / store.RUNS}")
        except OSError as err:
            notes.append(f"the collected tables are stale ({stale}) and cannot be rebuilt here "
                         f"({err.strerror or err}): run `kvbench collect {root}` where they can be written")
    path, pred_path = root / "metrics.parquet", root / "predictions.parquet"
    if not path.exists():
        if corrupt:
            raise ConfigError(f"no run under '{root}' reads back; {notes[0]}" if len(corrupt) == 1 else
                              f"none of the {len(corrupt)} runs under '{root}' reads back: `kvbench status {root}` "
                              "lists them with the command that runs each again")
        raise ConfigError(f"results root '{root}' has no metrics.parquet; run a sweep first "
                          f"(python -m kvbench -m ... results_root={root})")
    try:
        metrics = pd.read_parquet(path)
        predictions = pd.read_parquet(pred_path) if pred_path.exists() else pd.DataFrame(columns=["run_id"])
    except (OSError, ValueError) as err:  # pyarrow's errors are ValueErrors
        raise ConfigError(f"the collected tables in '{root}' cannot be read ({type(err).__name__}) nor rebuilt "
                          f"here: run `kvbench collect {root}`") from None
    return Results(metrics, predictions, notes)


def apply_filters(metrics: pd.DataFrame, filters: dict) -> pd.DataFrame:
    """Keep rows whose column value is among ``filters[column]`` (an empty list keeps all). Full-cache rows
    pass the budget and method filters: they are the reference every compressed row is compared with."""
    for column, wanted in filters.items():
        if column not in FILTER_COLUMNS:
            raise ConfigError(f"unknown report filter '{column}'; accepted: {', '.join(FILTER_COLUMNS)}")
        if not wanted:
            continue
        wanted = [str(w) for w in wanted]
        present = sorted(metrics[column].astype(str).unique())
        missing = [w for w in wanted if w not in present]
        if missing:
            raise ConfigError(f"report filter {column}={missing} matches no results; present: {', '.join(present)}")
        keep = metrics[column].astype(str).isin(wanted)
        if column in ("budget", "method"):
            keep |= metrics["method"] == "full"
        metrics = metrics[keep]
    return metrics


def variant_label(metrics: pd.DataFrame) -> pd.Series:
    """Per metric row: ``key=value`` of the hyperparameters that differ between runs of the same method and
    task (empty when they agree), so variants such as EMS positions=with/without are separate rows."""
    label = pd.Series("", index=metrics.index)
    for (_, _), group in metrics.groupby(["task", "method"], sort=False):
        candidates = [c for c in group.columns if c.startswith("method.") or c in VARIANT_COLUMNS]
        varying = [c for c in candidates if group[c].astype(str).nunique() > 1]
        if varying:
            label[group.index] = group[varying].astype(str).apply(
                lambda r: ",".join(f"{c.removeprefix('method.')}={v}" for c, v in r.items()), axis=1)
    return label


CELL = ["task", "model", "dataset", "metric", "length_bucket"]


def label_rows(metrics: pd.DataFrame) -> pd.DataFrame:
    """Adds ``row_method`` (method[variant]) and rewrites full-cache budgets to "full". Of duplicate results
    for one row x dataset x metric (full cache at several budgets, re-runs, runs with another ``limit``) the
    one kept is scored on the full cache's samples if there is one, else on the most samples (then the
    largest budget value, then the last run id); the full cache's own is the one on the most samples."""
    out = metrics.copy()
    variant = variant_label(out)
    out["variant"] = variant
    out["row_method"] = out["method"].where(variant == "", out["method"] + "[" + variant + "]")
    out["budget"] = out["budget"].astype(str).where(out["method"] != "full", FULL)
    if "length_bucket" not in out:
        out["length_bucket"] = "all"
    out["length_bucket"] = out["length_bucket"].fillna("all")
    if "sample_ids_hash" not in out:  # results written before rows carried their sample set
        out["sample_ids_hash"] = None
    keys = ["task", "model", "budget", "row_method", "dataset", "metric", "length_bucket"]
    out = out.sort_values(["n", "budget_value", "run_id"], kind="stable")
    full = out[out["budget"] == FULL].drop_duplicates(CELL, keep="last")
    reference = out[CELL].merge(full[CELL + ["sample_ids_hash"]], on=CELL, how="left")["sample_ids_hash"]
    out["full_samples"] = reference.to_numpy()
    out["aligned"] = out["sample_ids_hash"].notna() & (out["sample_ids_hash"] == out["full_samples"])
    out = out.sort_values(["aligned", "n", "budget_value", "run_id"], kind="stable")
    return out.drop_duplicates(keys, keep="last").drop(columns="aligned").reset_index(drop=True)


def other_samples(metrics: pd.DataFrame) -> pd.Series:
    """Per labelled metric row: True where it was scored on other samples than the full cache's row of the
    same model and dataset (both sample sets known and different)."""
    return (metrics["sample_ids_hash"].notna() & metrics["full_samples"].notna()
            & (metrics["sample_ids_hash"] != metrics["full_samples"]))


def align_by_kept(metrics: pd.DataFrame, step: float) -> pd.DataFrame:
    """Re-block compressed rows by their realized kept fraction instead of the budget label: ``budget``
    becomes ``kept<f>`` with f the run's ``kept_fraction`` rounded to a multiple of ``step`` (kind "kept"), and
    the budget label moves into the row's method as ``method@label``, so that methods whose realized sizes
    differ from their labels (KVMerger's threshold-driven size) line up with those that keep as much."""
    if not step > 0:
        raise ConfigError(f"table.kept_step={step} must be > 0")
    out = metrics.copy()
    kept = out["kept_fraction"] if "kept_fraction" in out else pd.Series(float("nan"), index=out.index)
    compressed = (out["budget"] != FULL) & kept.notna()
    value = (kept[compressed] / step).round() * step
    out.loc[compressed, "row_method"] = out.loc[compressed, "row_method"] + "@" + out.loc[compressed, "budget"]
    out.loc[compressed, "budget"] = KEPT + value.map(lambda v: f"{v:.4g}")
    out.loc[compressed, "budget_kind"] = "kept"
    out.loc[compressed, "budget_value"] = value
    return out


def labelled_predictions(results: Results, metrics: pd.DataFrame) -> pd.DataFrame:
    """Per-sample rows of the runs behind ``metrics`` (labelled) with their row labels and realized kept
    fraction."""
    columns = ["run_id", "task", "model", "budget", "method", "row_method", "variant", "budget_kind", "budget_value"]
    labels = metrics.drop_duplicates("run_id")[columns + [c for c in ("kept_fraction",) if c in metrics]]
    return results.predictions.merge(labels, on="run_id", how="inner")
