"""What each run under a results root is doing: ``<root>/status/<run_id>.json`` says "running" (with host,
pid and SLURM job), "failed" (with the error) or "interrupted" (Ctrl-C) until the run is published; a
published run is "done" when its files read back and "corrupt" when they do not (``store.unreadable``).
``kvbench status`` prints these states; a "running" record whose process is gone shows as "stale": on SLURM
the queue decides (so this works from any node), elsewhere the pid on its host. Every state but done and
running comes with ``rerun_command``, the command that runs the run again."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from kvbench import store


def slurm_job() -> dict:
    """This process's SLURM job: ``slurm_job_id`` (the unique job id) and ``slurm_job``, the id ``scancel``
    and ``squeue`` show (``<array job>_<task>`` for a point of an array, as submitit submits sweeps)."""
    job = os.environ.get("SLURM_JOB_ID")
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return {"slurm_job_id": job, "slurm_job": f"{array}_{task}" if array and task else job}


def _path(root: Path, rid: str) -> Path:
    return Path(root) / store.STATUS / f"{rid}.json"


def mark(root: Path, rid: str, state: str, **info) -> None:
    """Record that run ``rid`` is "running", "failed" or "interrupted" (atomically; the finished state is the
    run dir). A write that fails (a full disk) leaves the previous record and no temp file."""
    path = _path(root, rid)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    record = {"run_id": rid, "state": state, "host": socket.gethostname(), "pid": os.getpid(), **slurm_job(),
              "time": time.time(), **info}
    try:
        tmp.write_text(json.dumps(record, default=str))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def sigint_held():
    """SIGINT ignored while a run's end is recorded (in the main thread, where Python handles signals): a
    second Ctrl-C must not cut the record of the first short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def clear(root: Path, rid: str) -> None:
    _path(root, rid).unlink(missing_ok=True)


def run_states(root: Path) -> list[dict]:
    """Every known run with its state: done, corrupt (published, but its files do not read back: the
    ``error`` says which), running, failed, interrupted, or stale (marked running by a process that no
    longer exists: it crashed, was killed or cancelled)."""
    root = Path(root)
    records = {}
    for run in store.published_runs(root):
        records[run.name] = published_record(run)
    status_dir = root / store.STATUS
    running = []
    for path in sorted(status_dir.glob("*.json")) if status_dir.exists() else []:
        rid = path.stem
        if rid in records:
            continue
        try:
            records[rid] = {"run_id": rid, **json.loads(path.read_text())}
        except (OSError, ValueError) as err:
            records[rid] = {"run_id": rid, "state": "corrupt", "error": f"{path.name}: {err}"}
            continue
        if records[rid].get("state") == "running":
            running.append(records[rid])
    queued = slurm_queue([r["slurm_job_id"] for r in running if r.get("slurm_job_id")])
    for record in running:
        if not _alive(record, queued):
            record["state"] = "stale"
    return list(records.values())


def rerun_command(root: Path, record: dict) -> str:
    """The command that runs a run of ``root`` again: ``python -m kvbench`` with the overrides it was started
    with (the runner records them), else with its saved config.yaml; "" when neither is known. An unreadable
    published run is not finished, so the command runs it again (its copy is kept as ``<run_id>.prev``)."""
    overrides = record.get("overrides")
    if isinstance(overrides, list):
        # budget=0.2 as typed: the command line quotes budget choices itself (__main__.quote_numeric_choices)
        typed = [re.sub(r"^budget='([^']*)'$", r"budget=\1", str(o)) for o in overrides]
        kept = [o for o in typed if not o.lstrip("+~").startswith("results_root=")]
        return "python -m kvbench " + shlex.join([*kept, f"results_root={root}"])
    config = store.run_dir(root, record["run_id"]) / "config.yaml"
    if config.is_file() and config.stat().st_size:
        return (f"python -m kvbench --config-path {shlex.quote(str(config.parent))} --config-name config "
                + shlex.quote(f"results_root={root}"))
    return ""


def what_to_do(root: Path, record: dict) -> str:
    """The fix for a run that is not done: the command that runs it again, or its sweep."""
    command = rerun_command(root, record)
    return f"run it again: {command}" if command else "run its sweep again (finished points are skipped)"


def published_record(run: Path) -> dict:
    """A published run's record: its meta.json (as far as it reads) with state "done", or "corrupt" and the
    reason it does not read back as ``error``."""
    reason = store.unreadable(run)
    try:
        meta = store.read_meta(run)
    except (OSError, ValueError):
        meta = {}
    record = {**meta, "run_id": run.name, "state": "corrupt" if reason else "done"}
    if reason:
        record["error"] = reason
    return record


def _alive(record: dict, queued: set[str] | None) -> bool:
    """A running record's process still exists: its SLURM job is queued (when the queue can be asked), else
    its pid exists on its host (unknowable from another host: taken as alive)."""
    if record.get("slurm_job_id") and queued is not None:
        return str(record["slurm_job_id"]) in queued
    if record.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(record["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def slurm_queue(job_ids: list[str]) -> set[str] | None:
    """Which of ``job_ids`` SLURM still has queued or running, as job ids and as ``<array job>_<task>``
    ids; None when the queue cannot be asked."""
    if not job_ids:
        return set()
    try:
        out = subprocess.run(["squeue", "-h", "-o", "%A %i", "-j", ",".join(sorted(set(map(str, job_ids))))],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        # squeue refuses a list whose every id has left the queue; any other failure leaves us not knowing
        return set() if "Invalid job id" in out.stderr else None
    return set(out.stdout.split())


def overlapping_runs(root: Path, rid: str, device_id: str, start: float, end: float) -> list[str]:
    """Other runs in ``root`` on this host and device whose running time overlapped [start, end] (epoch
    seconds): their timings and ours were taken while they competed for the same cores or GPU."""
    host = socket.gethostname()
    out = []
    for record in run_states(root):
        if record["run_id"] == rid or record.get("device_id") != device_id:
            continue
        if record.get("host", record.get("hostname")) != host:
            continue
        if record["state"] == "done":
            began, ended = (_epoch(record.get(k)) for k in ("start", "end"))
        elif record["state"] in ("running", "failed", "interrupted"):
            began = record.get("start", record["time"])
            ended = time.time() if record["state"] == "running" else record["time"]
        else:
            continue
        if began is not None and ended is not None and began < end and ended > start:
            out.append(record["run_id"])
    return out


def _epoch(iso: str | None) -> float | None:
    return dt.datetime.fromisoformat(iso).timestamp() if iso else None
