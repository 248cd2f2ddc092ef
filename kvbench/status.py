"""What each run under a results root is doing: ``<root>/status/<run_id>.json`` says "running" (with host,
pid and SLURM job) or "failed" (with the error) until the run is published (then its ``meta.json`` says
"done"). ``kvbench status`` prints these states; a "running" record whose process is gone shows as
"stale": on SLURM the queue decides (so this works from any node), elsewhere the pid on its host."""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import subprocess
import time
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
    """Record that run ``rid`` is "running" or "failed" (atomically; the finished state is the run dir)."""
    path = _path(root, rid)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    record = {"run_id": rid, "state": state, "host": socket.gethostname(), "pid": os.getpid(), **slurm_job(),
              "time": time.time(), **info}
    tmp.write_text(json.dumps(record, default=str))
    os.replace(tmp, path)


def clear(root: Path, rid: str) -> None:
    _path(root, rid).unlink(missing_ok=True)


def run_states(root: Path) -> list[dict]:
    """Every known run with its state: done, running, failed, stale (marked running by a process that no
    longer exists: it crashed, was killed or cancelled) or corrupt (its record cannot be read)."""
    root = Path(root)
    records = {}
    for run in store.finished_runs(root):
        try:
            records[run.name] = {"run_id": run.name, "state": "done", **store.read_meta(run)}
        except (OSError, ValueError) as err:
            records[run.name] = {"run_id": run.name, "state": "corrupt", "error": f"meta.json: {err}"}
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
        elif record["state"] in ("running", "failed"):
            began = record.get("start", record["time"])
            ended = time.time() if record["state"] == "running" else record["time"]
        else:
            continue
        if began is not None and ended is not None and began < end and ended > start:
            out.append(record["run_id"])
    return out


def _epoch(iso: str | None) -> float | None:
    return dt.datetime.fromisoformat(iso).timestamp() if iso else None
