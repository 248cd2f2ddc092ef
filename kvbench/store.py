"""Results store: one directory per run, written atomically, and one collected table for all runs.

    <root>/runs/<run_id>/        config.yaml, predictions.parquet, metrics.parquet, meta.json
    <root>/runs/<run_id>.prev/   the run that a re-run with skip_finished=false replaced (the latest only)
    <root>/metrics.parquet       every finished run's metric rows (pandas.read_parquet reads it)
    <root>/predictions.parquet   every finished run's per-sample rows

``run_id`` hashes the resolved config values that change a result, so a re-run (or a resubmitted sweep)
finds its finished directory and skips it. A run is written into a temporary sibling directory, read back,
and renamed into place at the end: an interrupted run leaves no directory that looks finished. meta.json,
written last, lists every file with its size (and a parquet file's row count), so that ``unreadable`` tells
cheaply whether a published run still reads back: a run is finished only when it does. ``kvbench status``, a
re-run (which runs an unreadable run again), ``collect`` and the report all ask ``unreadable``.

The collected tables are rebuilt under a file lock (concurrent SLURM jobs) and also replaced by rename;
``collect`` rebuilds them from ``runs/`` at any time (``kvbench collect ROOT``), leaving out unreadable runs;
every publication rebuilds them, and a skipped re-run and the report rebuild them when they do not hold
exactly the finished runs (``stale_tables``: after a full disk, say).
"""

from __future__ import annotations

import ctypes
import errno
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
from typing import Iterable

import pandas as pd
import pyarrow.parquet as pq

from kvbench.errors import describe, disk_full

log = logging.getLogger("kvbench")

RUNS = "runs"
STATUS = "status"  # <root>/status/<run_id>.json: running, failed or interrupted while not finished (kvbench.status)
FINISHED_MARKER = "meta.json"  # written last inside the temp dir; the rename publishes all files at once
FILES = "files"  # meta.json key: relative path -> {"bytes": size, "rows": parquet rows} of every other file
DATA_FILES = ("config.yaml", "predictions.parquet", "metrics.parquet")  # what a run without FILES must hold
TABLES = ("metrics", "predictions")  # <root>/<name>.parquet: the collected tables
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
    """Published and readable: a run that does not read back is not finished (a re-run runs it again)."""
    run = run_dir(root, rid)
    return (run / FINISHED_MARKER).exists() and unreadable(run) is None


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
    tables: bool = True,
) -> Path:
    """Publish a finished run atomically (with the task's extra ``artifacts``: relative path -> text);
    optionally also copy its files into ``copy_to`` (the Hydra run dir). ``replace``: a run already published
    under ``rid`` is swapped out (kept as ``<rid>.prev``) instead of keeping it and discarding this one.
    ``tables``: rebuild the collected tables (False: the caller rebuilds them once after several runs)."""
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
        files = _read_back(tmp, {"predictions.parquet": len(predictions), "metrics.parquet": len(metrics)})
        (tmp / FINISHED_MARKER).write_text(json.dumps({**meta, FILES: files}, indent=2, default=str))
        read_meta(tmp)
        final = run_dir(root, rid)
        if final.exists() and (replace or unreadable(final) is not None):
            _replace(tmp, final)  # asked to, or the published run does not read back
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
    # Published: what follows is a convenience, and a failure of it (a full disk) never fails the run.
    if copy_to is not None:
        try:
            _mirror(final, Path(copy_to))
        except OSError as err:
            log.warning("run %s is published in %s; its copy in %s is incomplete (%s)", rid, final, copy_to,
                        describe(err))
    if tables:
        update_tables(root)
    return final


def _read_back(folder: Path, rows: dict[str, int]) -> dict[str, dict]:
    """Every file of a run about to be published with its size, after reading each parquet file of ``rows``
    (name -> rows written) back whole: a run is published only when its files read back."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        files[name] = {"bytes": path.stat().st_size}
        if name in rows:
            read = len(pd.read_parquet(path))
            if read != rows[name]:
                raise OSError(errno.EIO, f"{name} read back {read} of the {rows[name]} rows written", str(path))
            files[name]["rows"] = read
    return files


def unreadable(run: Path) -> str | None:
    """Why a published run does not read back, or None when it does: meta.json parses, and every file it
    lists has the size written (a parquet file also its footer and row count). A run published before
    meta.json listed its files must hold DATA_FILES with readable parquet footers. Reads no data pages, so
    ``kvbench status`` can ask it of every run; ``collect``, which reads every byte, can still find a file
    changed in place to the same size."""
    try:
        files = read_meta(run).get(FILES, dict.fromkeys(DATA_FILES, {}))
    except (OSError, ValueError) as err:
        return f"{FINISHED_MARKER}: {_reason(err, run / FINISHED_MARKER)}"
    if not isinstance(files, dict) or not all(isinstance(entry, dict) for entry in files.values()):
        return f"{FINISHED_MARKER}: its list of files is damaged"
    for name, written in files.items():
        path = run / name
        try:
            size = path.stat().st_size
            if written.get("bytes", size) != size:
                return f"{name} has {size} bytes of the {written['bytes']} written"
            if path.suffix == ".parquet":
                rows = pq.read_metadata(path).num_rows
                if written.get("rows", rows) != rows:
                    return f"{name} has {rows} rows of the {written['rows']} written"
        except (OSError, ValueError) as err:  # pyarrow's errors are ValueErrors
            return f"{name}: {_reason(err, path)}"
    return None


def _reason(err: Exception, path: Path) -> str:
    if isinstance(err, FileNotFoundError):
        return "missing"
    return f"{type(err).__name__}: " + str(err).replace(f" '{path}'", "").replace(str(path), path.name)


def _mirror(run: Path, target: Path) -> None:
    """``target`` (the run's Hydra folder) gets the run's files as hard links where the filesystem allows
    (no space used), else as copies."""
    for path in sorted(run.rglob("*")):
        dest = target / path.relative_to(run)
        if path.is_dir():
            dest.mkdir(parents=True, exist_ok=True)
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.unlink(missing_ok=True)
        try:
            os.link(path, dest)
        except OSError as err:
            if disk_full(err):
                raise
            shutil.copy2(path, dest)  # another filesystem, or one without hard links


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


def published_runs(root: Path) -> list[Path]:
    """Published run directories, readable or not (not temp dirs, not replaced ``.prev`` copies)."""
    runs = Path(root) / RUNS
    if not runs.exists():
        return []
    return sorted(p for p in runs.iterdir() if not p.name.startswith(".") and not p.name.endswith(PREVIOUS)
                  and (p / FINISHED_MARKER).exists())


def finished_runs(root: Path) -> list[Path]:
    """Published runs that read back."""
    return [run for run in published_runs(root) if unreadable(run) is None]


def read_meta(run: Path) -> dict:
    """A published run's meta.json; raises OSError or ValueError if it cannot be read."""
    meta = json.loads((run / FINISHED_MARKER).read_text())
    if not isinstance(meta, dict):
        raise ValueError(f"holds a {type(meta).__name__}, not an object")
    return meta


def collect(root: Path) -> list[tuple[str, str]]:
    """Rebuild ``metrics.parquet`` and ``predictions.parquet`` at the root from every finished run, and
    remove stray temp files. Runs that do not read back are left out and returned as (run id, reason).
    Raises OSError when a table cannot be written (a full disk)."""
    root = Path(root)
    skipped = []
    with _locked(root):
        remove_stray_temp(root)
        frames: dict[str, list[pd.DataFrame]] = {name: [] for name in TABLES}
        for run in published_runs(root):
            reason = unreadable(run)
            try:
                loaded = {} if reason else {name: pd.read_parquet(run / f"{name}.parquet") for name in frames}
            except (OSError, ValueError) as err:  # a page damaged in place (pyarrow errors are ValueErrors)
                reason = f"{type(err).__name__}: {err}"
            if reason:
                skipped.append((run.name, reason))
                continue
            for name, frame in loaded.items():
                if len(frame):
                    frames[name].append(frame)
        for name, parts in frames.items():
            if parts:
                _write_parquet(pd.concat(parts, ignore_index=True), root / f"{name}.parquet")
            else:
                (root / f"{name}.parquet").unlink(missing_ok=True)
    return skipped


def stale_tables(root: Path, unreadable_runs: Iterable[str] = ()) -> str | None:
    """Why the collected tables do not hold exactly the finished runs that have metric rows (None when they
    do): a table that cannot be read, finished runs missing from it, runs in it no longer published, or runs
    in it that no longer read back (those of ``unreadable_runs``: callers that verified every run pass the
    unreadable ones). Reads the tables' run ids and verifies only the runs missing from them."""
    root = Path(root)
    published = {run.name: run for run in published_runs(root)}
    path = root / "metrics.parquet"
    try:
        collected = set(pd.read_parquet(path, columns=["run_id"])["run_id"]) if path.exists() else set()
        if (root / "predictions.parquet").exists():
            pq.read_metadata(root / "predictions.parquet")
    except (OSError, ValueError) as err:
        return f"cannot be read ({type(err).__name__})"
    missing = [rid for rid in set(published) - collected if _has_metric_rows(published[rid])]
    if missing:
        return f"{len(missing)} finished runs are missing from them"
    gone = collected - set(published)
    if gone:
        return f"they hold {len(gone)} runs no longer in {RUNS}/"
    damaged = collected & set(unreadable_runs)
    return f"they hold {len(damaged)} runs that no longer read back" if damaged else None


def _has_metric_rows(run: Path) -> bool:
    """A readable run that the collected metrics table must hold (runs without metric rows add none)."""
    if unreadable(run) is not None:
        return False
    return read_meta(run).get(FILES, {}).get("metrics.parquet", {}).get("rows", 1) > 0


def update_tables(root: Path, only_if_stale: bool = False) -> None:
    """Rebuild the collected tables (``only_if_stale``: only when ``stale_tables`` says so), as a run does
    when it publishes or is skipped. A run left out is a warning; so is a failure to write the tables (a full
    disk): the runs are safe, and the next run, the report or ``kvbench collect`` rebuilds them."""
    try:
        skipped = [] if only_if_stale and not stale_tables(root) else collect(root)
    except OSError as err:
        log.warning("the collected tables in %s were not rebuilt (%s): the next run, the report or `kvbench "
                    "collect %s` rebuilds them once there is room", root, describe(err), root)
        return
    for rid, reason in skipped:
        log.warning("run %s left out of the collected tables: %s (`kvbench status %s` says how to run it "
                    "again)", run_dir(root, rid), reason, root)


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
