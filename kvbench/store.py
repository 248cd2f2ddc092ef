"""Results store: one directory per run, written atomically, and one collected table for all runs.

    <root>/runs/<run_id>/        config.yaml, predictions.parquet, metrics.parquet, meta.json
    <root>/runs/<run_id>.prev/   the run that a re-run with skip_finished=false replaced (the latest only)
    <root>/metrics.parquet       every finished run's metric rows (pandas.read_parquet reads it)
    <root>/predictions.parquet   every finished run's per-sample rows

``run_id`` hashes the resolved config values that change a result, so a re-run (or a resubmitted sweep)
finds its finished directory and skips it. A run is written into a temporary sibling directory and renamed
into place at the end: an interrupted run leaves no directory that looks finished. The collected tables are
rebuilt under a file lock (concurrent SLURM jobs) and also replaced by rename; ``collect`` rebuilds them from
``runs/`` at any time (``kvbench collect ROOT``), skipping runs whose files cannot be read.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

log = logging.getLogger("kvbench")

RUNS = "runs"
STATUS = "status"  # <root>/status/<run_id>.json: "running" or "failed" while not finished (kvbench.status)
FINISHED_MARKER = "meta.json"  # written last inside the temp dir; the rename publishes all files at once
PREVIOUS = ".prev"  # runs/<run_id>.prev: the published run a forced re-run replaced
# Temp run dirs and status temp files are written without the collect lock; one untouched this long has no
# writer left (writing a run's files takes seconds).
STALE_TEMP_SECONDS = 3600


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
    try:
        df.to_parquet(tmp, index=False)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not leave half a table behind
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_run(
    root: Path, rid: str, config_yaml: str, predictions: pd.DataFrame, metrics: pd.DataFrame, meta: dict,
    copy_to: Path | None = None, artifacts: dict[str, str] | None = None, replace: bool = False,
) -> Path:
    """Publish a finished run atomically (with the task's extra ``artifacts``: relative path -> text);
    optionally also copy its files into ``copy_to`` (the Hydra run dir). ``replace``: a run already published
    under ``rid`` is swapped out (kept as ``<rid>.prev``) instead of keeping it and discarding this one."""
    runs = Path(root) / RUNS
    runs.mkdir(parents=True, exist_ok=True)
    # resolved, so that the artifact guard below compares real paths under a symlinked results root
    tmp = Path(tempfile.mkdtemp(prefix=f".{rid}-", dir=runs)).resolve()
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would hide published runs from the group
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
        if replace and final.exists():
            _replace(tmp, final)
        else:
            try:
                os.rename(tmp, final)
            except OSError:
                # Another job finished the same point first (e.g. a requeued job and its resubmission): a
                # published run is never replaced unasked, so readers never see it vanish; ours is discarded.
                if not is_finished(root, rid):
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if copy_to is not None:
        shutil.copytree(final, copy_to, dirs_exist_ok=True)
    try:
        collect(root)
    except OSError as err:  # e.g. a full disk: the run itself is safe; the tables can be rebuilt later
        log.warning("run %s is published, but the collected tables were not rebuilt (%s); "
                    "run `kvbench collect %s` once there is room", rid, err, root)
    return final


def _replace(tmp: Path, final: Path) -> None:
    """Publish ``tmp`` as ``final``, moving the run published there to ``<final>.prev`` (an older one is
    dropped). Where the kernel can exchange two directories in one step, readers see the old run or the new
    one and never neither; elsewhere there is a moment between two renames."""
    previous = final.with_name(final.name + PREVIOUS)
    shutil.rmtree(previous, ignore_errors=True)
    if _exchange(tmp, final):
        os.rename(tmp, previous)  # tmp now holds the old run
    else:
        os.rename(final, previous)
        os.rename(tmp, final)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with Linux's renameat2(RENAME_EXCHANGE); False where unsupported."""
    rename = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if rename is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    return rename(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


@contextmanager
def _locked(root: Path):
    with open(Path(root) / ".collect.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def finished_runs(root: Path) -> list[Path]:
    """Published run directories (not temp dirs, not replaced ``.prev`` copies)."""
    runs = Path(root) / RUNS
    if not runs.exists():
        return []
    return sorted(p for p in runs.iterdir() if not p.name.startswith(".") and not p.name.endswith(PREVIOUS)
                  and (p / FINISHED_MARKER).exists())


def read_meta(run: Path) -> dict:
    """A published run's meta.json; raises OSError or ValueError if it cannot be read."""
    return json.loads((run / FINISHED_MARKER).read_text())


def collect(root: Path) -> list[tuple[str, str]]:
    """Rebuild ``metrics.parquet`` and ``predictions.parquet`` at the root from every finished run, and
    remove stray temp files. A run whose files cannot be read is left out (a warning names it): returns
    those as (run id, reason)."""
    root = Path(root)
    skipped = []
    with _locked(root):
        remove_stray_temp(root)
        frames: dict[str, list[pd.DataFrame]] = {"metrics": [], "predictions": []}
        for run in finished_runs(root):
            try:
                read_meta(run)
                loaded = {name: pd.read_parquet(run / f"{name}.parquet") for name in frames}
            except (OSError, ValueError) as err:  # truncated or corrupt files (pyarrow errors are ValueErrors)
                skipped.append((run.name, f"{type(err).__name__}: {err}"))
                continue
            for name, frame in loaded.items():
                if len(frame):
                    frames[name].append(frame)
        for name, parts in frames.items():
            if parts:
                _write_parquet(pd.concat(parts, ignore_index=True), root / f"{name}.parquet")
            else:
                (root / f"{name}.parquet").unlink(missing_ok=True)
    for rid, reason in skipped:
        log.warning("run %s left out of the collected tables: %s", run_dir(root, rid), reason)
    return skipped


def remove_stray_temp(root: Path) -> list[Path]:
    """Delete temp files that no writer will finish: collected-table temps (written only under the collect
    lock, which the caller holds) and temp run dirs / status temps untouched for STALE_TEMP_SECONDS."""
    root = Path(root)
    cutoff = time.time() - STALE_TEMP_SECONDS
    old = [p for pattern in (f"{RUNS}/.*", f"{STATUS}/.*.tmp") for p in root.glob(pattern)
           if p.lstat().st_mtime < cutoff]
    removed = list(root.glob(".*.tmp")) + old
    for path in removed:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return removed


def run_label(record: dict) -> str:
    """``model / method / budget / task``: how rows, progress bars, ``kvbench status`` and W&B name a run."""
    return " / ".join(str(record.get(key, "")) for key in ("model", "method", "budget", "task"))
