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
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

RUNS = "runs"
STATUS = "status"  # <root>/status/<run_id>.json: "running" or "failed" (with the error) while not finished
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
    copy_to: Path | None = None, artifacts: dict[str, str] | None = None,
) -> Path:
    """Publish a finished run atomically (with the task's extra ``artifacts``: relative path -> text);
    optionally also copy its files into ``copy_to`` (the Hydra run dir)."""
    runs = Path(root) / RUNS
    runs.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{rid}-", dir=runs))
    try:
        (tmp / "config.yaml").write_text(config_yaml)
        predictions.to_parquet(tmp / "predictions.parquet", index=False)
        metrics.to_parquet(tmp / "metrics.parquet", index=False)
        for name, text in (artifacts or {}).items():
            path = tmp / name
            if tmp not in path.resolve().parents:
                raise ValueError(f"artifact path '{name}' leaves the run directory")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        (tmp / FINISHED_MARKER).write_text(json.dumps(meta, indent=2, default=str))
        final = run_dir(root, rid)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another job finished the same point first (e.g. a requeued job and its resubmission): a published
            # run is never replaced, so readers never see it vanish; ours is discarded.
            if not is_finished(root, rid):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if copy_to is not None:
        shutil.copytree(final, copy_to, dirs_exist_ok=True)
    clear_mark(root, rid)
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


def _status_path(root: Path, rid: str) -> Path:
    return Path(root) / STATUS / f"{rid}.json"


def mark(root: Path, rid: str, state: str, **info) -> None:
    """Record that run ``rid`` is "running" or "failed" (atomically; the finished state is the run dir)."""
    path = _status_path(root, rid)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    record = {"run_id": rid, "state": state, "host": socket.gethostname(), "pid": os.getpid(),
              "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "time": time.time(), **info}
    tmp.write_text(json.dumps(record, default=str))
    os.replace(tmp, path)


def clear_mark(root: Path, rid: str) -> None:
    _status_path(root, rid).unlink(missing_ok=True)


def run_states(root: Path) -> list[dict]:
    """Every known run with its state: done, running, failed, or stale (marked running by a process on
    this host that no longer exists: it crashed or was killed)."""
    root = Path(root)
    records = {d.name: {"run_id": d.name, "state": "done", **json.loads((d / FINISHED_MARKER).read_text())}
               for d in finished_runs(root)}
    status_dir = root / STATUS
    for path in sorted(status_dir.glob("*.json")) if status_dir.exists() else []:
        record = json.loads(path.read_text())
        if record["run_id"] in records:
            continue
        if record["state"] == "running" and record["host"] == socket.gethostname() and not _alive(record["pid"]):
            record["state"] = "stale"
        records[record["run_id"]] = record
    return list(records.values())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
