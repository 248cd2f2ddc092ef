"""Sweeps through a real single-node SLURM cluster (slurmctld + slurmd + munged started by the test).

Needs root and Debian's slurm-wlm + munge (``scripts/slurm_cluster.sh install``; CI installs them);
skipped otherwise. Checks that every sweep point lands in the shared results root (a fused group as one
job), that a job cancelled
mid-run (by the id ``kvbench status`` shows) ends the launcher's wait and is redone on resubmission while
finished points are not touched, that a point failing in its job is reported without hanging the
launcher, and that the cluster script stops only the daemons it started.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pandas as pd
import pytest

from kvbench import status, store
from tests.conftest import REPO

# Skipped on a developer machine without SLURM; never in CI, whose script installs it (a skip there would
# hide a broken cluster test).
pytestmark = pytest.mark.skipif(
    not os.environ.get("CI")
    and (shutil.which("slurmctld") is None or shutil.which("munged") is None or os.geteuid() != 0),
    reason="needs root and slurm-wlm + munge (scripts/slurm_cluster.sh install)",
)
SCRIPT = REPO / "scripts" / "slurm_cluster.sh"


def started_pids(cluster) -> list[int]:
    return [int((cluster / f"{d}.pid").read_text()) for d in ("slurmctld", "slurmd", "munged")
            if (cluster / f"{d}.pid").exists()]


def alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}") and "zombie" not in open(f"/proc/{pid}/status").read().lower()


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory):
    cluster = tmp_path_factory.mktemp("slurm")
    subprocess.run([str(SCRIPT), "start", str(cluster)], check=True, timeout=120)
    env = {**os.environ, "SLURM_CONF": str(cluster / "slurm.conf"), "PYTHONUNBUFFERED": "1",
           "KVBENCH_SUBMITIT_DIR": str(cluster / "submitit")}
    yield env
    pids = started_pids(cluster)
    subprocess.run([str(SCRIPT), "stop", str(cluster)], timeout=60)
    assert not [p for p in pids if alive(p)], "stop left a daemon it started running"


def sweep_command(root, *points, task="passkey"):
    return [
        sys.executable, "-m", "kvbench", "-m", "hydra/launcher=slurm", "hydra.launcher.partition=debug",
        "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=2",
        "hydra.launcher.timeout_min=10", "model=tiny-llama-random", f"task={task}", f"results_root={root}",
        *points,
    ]


def test_sweep_through_slurm_lands_every_point(slurm_env, tmp_path):
    proc = subprocess.run(
        sweep_command(tmp_path, "method=full,streamingllm", "budget=0.2,0.5", "task.context_lengths=[128]",
                      "task.depths=[0],[100]"),  # two groups of fused points: an array of two jobs
        env=slurm_env, cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = store.finished_runs(tmp_path)
    assert len(runs) == 6  # the full cache ignores the budget: one run for both budgets
    states = status.run_states(tmp_path)
    assert {s["state"] for s in states} == {"done"}
    assert all(s.get("slurm_job_id") for s in states), "each point ran as a SLURM job"
    assert all(re.fullmatch(r"\d+_\d+", s["slurm_job"]) for s in states), "the array id scancel takes"
    assert len({s["slurm_job"] for s in states}) == 2, "one SLURM job per fused group"
    assert "kvbench sweep: 8 points: 6 done, 2 skipped, 0 failed" in proc.stdout
    metrics = pd.read_parquet(tmp_path / "metrics.parquet")
    assert set(zip(metrics["method"], metrics["budget"])) == {
        ("full", "full"), ("streamingllm", "0.2"), ("streamingllm", "0.5")}
    assert set(metrics["fused_group_size"]) == {3}


def _wait_for_running(root, timeout=300) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        running = [s for s in status.run_states(root) if s["state"] == "running" and s.get("slurm_job_id")]
        if running:
            return running[0]
        time.sleep(0.5)
    raise AssertionError("no point started running under SLURM")


def _wait_until_gone(job_id, env, timeout=60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        queue = subprocess.run(["squeue", "-h", "-j", str(job_id)], env=env, capture_output=True, text=True)
        if str(job_id) not in queue.stdout:
            return
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} still queued after scancel")


def test_killed_job_is_redone_on_resubmission_and_finished_points_are_not(slurm_env, tmp_path):
    quick = ["method=full,streamingllm", "budget=0.5", "task.context_lengths=[128]", "task.depths=[0]"]
    assert subprocess.run(sweep_command(tmp_path, *quick), env=slurm_env, cwd=REPO, capture_output=True,
                          timeout=600).returncode == 0
    finished = {p.name: (p / "meta.json").stat().st_mtime_ns for p in store.finished_runs(tmp_path)}
    assert len(finished) == 2

    slow = ["method=streamingllm", "budget=0.2", "task.context_lengths=[1024,2048]",
            "task.depths=[0,25,50,75,100]", "task.samples_per_cell=30"]  # minutes: long enough to kill
    launcher = subprocess.Popen(sweep_command(tmp_path, *slow), env=slurm_env, cwd=REPO, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        victim = _wait_for_running(tmp_path)
        time.sleep(2)
        subprocess.run(["scancel", victim["slurm_job"]], env=slurm_env, check=True)  # the id kvbench status shows
        _wait_until_gone(victim["slurm_job_id"], slurm_env)
        # Without slurmdbd submitit cannot learn that a cancelled job ended (no sacct); the launcher sees the
        # job gone from the queue without a result and reports the point as failed instead of waiting for ever.
        _, err = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:  # a failed wait above: do not leave the launcher polling a dead cluster
            launcher.kill()
    assert launcher.returncode == 1 and "1 failed" in err and "left the queue without a result" in err, err
    assert not store.is_finished(tmp_path, victim["run_id"])
    states = {s["run_id"]: s["state"] for s in status.run_states(tmp_path)}
    assert states[victim["run_id"]] == "stale", "the killed point shows as stale in kvbench status"
    assert not list((tmp_path / "runs").glob(".*")), "no half-written run directory"

    again = subprocess.run(sweep_command(tmp_path, *slow), env=slurm_env, cwd=REPO, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert store.is_finished(tmp_path, victim["run_id"]), (status.run_states(tmp_path), again.stderr[-3000:])
    for name, mtime in finished.items():
        assert (tmp_path / "runs" / name / "meta.json").stat().st_mtime_ns == mtime, "finished point redone"
    assert len(pd.read_parquet(tmp_path / "metrics.parquet")["run_id"].unique()) == 3


def test_a_point_failing_in_its_job_is_reported_without_hanging(slurm_env, tmp_path):
    proc = subprocess.run(  # passes the checks before submission; fails when the job builds the prompt
        sweep_command(tmp_path / "results", "method=full", "budget=0.2", "task.context_lengths=[128]",
                      "task.depths=[0]", "model.max_length=100"),
        env=slurm_env, cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "kvbench sweep: 1 points: 0 done, 0 skipped, 1 failed" in proc.stderr
    assert "has max_length=100" in proc.stderr
    assert [s["state"] for s in status.run_states(tmp_path / "results")] == ["failed"]


def test_stop_leaves_another_cluster_running(slurm_env, tmp_path):
    """A second cluster on free ports; stopping it stops its own daemons only (no pkill by name)."""
    subprocess.run([str(SCRIPT), "start", str(tmp_path)], check=True, timeout=120)
    second = started_pids(tmp_path)
    subprocess.run([str(SCRIPT), "stop", str(tmp_path)], check=True, timeout=60)
    assert not [p for p in second if alive(p)]
    up = subprocess.run(["sinfo", "-h", "-o", "%T"], env=slurm_env, capture_output=True, text=True, timeout=30)
    assert up.returncode == 0 and up.stdout.strip() in ("idle", "mixed", "allocated"), up.stderr
