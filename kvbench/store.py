"""Results store: one directory per run, written atomically, and one collected table for all runs.

    <root>/runs/<run_id>/        config.yaml, predictions.parquet, metrics.parquet, meta.json
    <root>/metrics.parquet       every finished run's metric rows (pandas.read_parquet reads it)
    <root>/predictions.parquet   every finished run's per-sample rows

``run_id`` hashes the resolved config values that change a result, so a re-run (or a resubmitted sweep)
finds its finished directory and skips it. A run is written into a temporary sibling directory and renamed
into place at the end: an interrupted run leaves no directory that looks finished. The collected tables are
rebuilt under a file lock (concurrent SLURM jobs) and also replaced by rename.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

RUNS = "runs"
FINISHED_MARKER = "meta.json"  # written last inside the temp dir; the rename publishes all files at once


def run_id(config: dict) -> str:
    """Stable 16-hex id of a resolved config (dict of plain values; key order does not matter)."""
    blob = json.dumps(config, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def run_dir(root: Path, rid: str) -> Path:
    return Path(root) / RUNS / rid


def is_finished(root: Path, rid: str) -> bool:
    return (run_dir(root, rid) / FINISHED_MARKER).exists()


def _write_parquet(df: pd.DataFrame, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    df.to_parquet(tmp, index=False)
    os.replace(tmp, path)


def write_run(
    root: Path, rid: str, config_yaml: str, predictions: pd.DataFrame, metrics: pd.DataFrame, meta: dict,
    copy_to: Path | None = None,
) -> Path:
    """Publish a finished run atomically; optionally also copy its files into ``copy_to`` (the Hydra run dir)."""
    runs = Path(root) / RUNS
    runs.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{rid}-", dir=runs))
    try:
        (tmp / "config.yaml").write_text(config_yaml)
        predictions.to_parquet(tmp / "predictions.parquet", index=False)
        metrics.to_parquet(tmp / "metrics.parquet", index=False)
        (tmp / FINISHED_MARKER).write_text(json.dumps(meta, indent=2, default=str))
        final = run_dir(root, rid)
        if final.exists():  # a half-published or stale directory from a crashed run: replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if copy_to is not None:
        copy_to.mkdir(parents=True, exist_ok=True)
        for name in ("config.yaml", "predictions.parquet", "metrics.parquet", FINISHED_MARKER):
            shutil.copy2(final / name, copy_to / name)
    collect(root)
    return final


@contextmanager
def _locked(root: Path):
    with open(Path(root) / ".collect.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def finished_runs(root: Path) -> list[Path]:
    runs = Path(root) / RUNS
    if not runs.exists():
        return []
    return sorted(p for p in runs.iterdir() if not p.name.startswith(".") and (p / FINISHED_MARKER).exists())


def collect(root: Path) -> None:
    """Rebuild ``metrics.parquet`` and ``predictions.parquet`` at the root from every finished run."""
    root = Path(root)
    with _locked(root):
        for name in ("metrics", "predictions"):
            frames = [pd.read_parquet(d / f"{name}.parquet") for d in finished_runs(root)]
            frames = [f for f in frames if len(f)]
            if frames:
                _write_parquet(pd.concat(frames, ignore_index=True), root / f"{name}.parquet")


def load_metrics(root: Path) -> pd.DataFrame:
    path = Path(root) / "metrics.parquet"
    return pd.read_parquet(path) if path.exists() else pd.DataFrame()
