"""Sweeps: the launchers' summary, one full-cache run per budget sweep, a failing point that does not stop
(or hang) the sweep, the local launcher's concurrency cap, timings marked when runs shared a device, and
SLURM points that left the queue. Real SLURM is in test_slurm.py."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time

import pandas as pd
import pytest
from hydra.core.utils import JobReturn, JobStatus

from hydra_plugins import kvbench_launchers as launchers
from kvbench import runner, status, store
from kvbench.__main__ import entry
from tests.conftest import KEEP_LOGGING, REPO
from tests.test_runner import make_cfg

PASSKEY = ["model=tiny-llama-random", "task=passkey", "task.context_lengths=[128]", "task.depths=[0]"]
SAMPLE = REPO / "kvbench" / "data" / "longbench" / "sample"


def sweep(args: list[str], monkeypatch) -> tuple[int, str, str]:
    """``kvbench -m ARGS`` in this process (the sequential launcher): (exit status, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["kvbench", "-m", *args, *KEEP_LOGGING])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            entry()
            code = 0
        except SystemExit as stop:
            code = stop.code
    return code, out.getvalue(), err.getvalue()


def test_full_cache_runs_once_in_a_budget_sweep(tmp_path, monkeypatch):
    code, out, _ = sweep([*PASSKEY, "method=full,streamingllm", "budget=0.2,0.5", f"results_root={tmp_path}"],
                         monkeypatch)
    assert code == 0
    assert "kvbench sweep: 4 points: 3 done, 1 skipped, 0 failed" in out
    metrics = pd.read_parquet(tmp_path / "metrics.parquet")
    assert sorted(set(zip(metrics["method"], metrics["budget"]))) == [("full", "full"), ("streamingllm", "0.2"),
                                                                      ("streamingllm", "0.5")]


def test_a_failing_point_is_reported_and_the_sweep_goes_on(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "trec.jsonl").write_text("")
    args = ["model=tiny-llama-random", "method=full", "task=longbench", "task.datasets=[trec]", "task.source=local",
            f"task.data_dir={empty},{SAMPLE}", "limit=1", f"results_root={tmp_path / 'results'}"]
    code, _, err = sweep(args, monkeypatch)
    assert code == 1
    assert "kvbench sweep: 2 points: 1 done, 0 skipped, 1 failed" in err
    assert f"failed #0 model=tiny-llama-random method=full" in err and "holds no records" in err
    assert len(store.finished_runs(tmp_path / "results")) == 1


def test_a_point_failing_under_a_launcher_returns_a_result_instead_of_exiting(tmp_path, monkeypatch):
    """Under a sweep the job function returns ("failed", error): a SLURM job then writes its result pickle
    (sys.exit would leave none, and the launcher would wait for ever)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from kvbench.__main__ import main

    class Sweep:
        mode = RunMode.MULTIRUN
        runtime = type("runtime", (), {"output_dir": str(tmp_path / "out")})

    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: Sweep))
    cfg = make_cfg(tmp_path, "method=full", "task.context_lengths=[10]")
    assert main.__wrapped__(cfg) == ("failed", "ConfigError: passkey.context_lengths=[10]: each must be >= 64 tokens")


class FakeJob:
    """A submitit job of a group of points that finishes after ``polls`` calls of done()."""

    running: set = set()
    peak = 0

    def __init__(self, names: list[str], polls: int = 3, job_id: str = "1") -> None:
        self.names, self.polls, self.job_id = names, polls, job_id
        self.name = " ".join(names)
        FakeJob.running.add(self.name)
        FakeJob.peak = max(FakeJob.peak, len(FakeJob.running))

    def done(self) -> bool:
        self.polls -= 1
        if self.polls <= 0:
            FakeJob.running.discard(self.name)
        return self.polls <= 0

    def results(self):
        return [[JobReturn(overrides=[], _return_value=("done", name), status=JobStatus.COMPLETED)
                 for name in self.names]]


class FakeExecutor:
    gpus_seen: list = []

    def __init__(self, folder) -> None:
        self.parameters = {}

    def update_parameters(self, **kwargs) -> None:
        self.parameters.update(kwargs)

    def submit(self, fn, points, *args):
        FakeExecutor.gpus_seen.append(self.parameters["visible_gpus"])
        return FakeJob([" ".join(overrides) for _, overrides in points])


@pytest.mark.parametrize(("max_parallel", "peak"), [(None, 1), (2, 2)])
def test_local_launcher_runs_at_most_max_parallel_points_at_once(max_parallel, peak, tmp_path, monkeypatch):
    import submitit
    import torch

    monkeypatch.setattr(submitit, "LocalExecutor", FakeExecutor)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the default is then one point at a time
    monkeypatch.setattr(launchers, "POLL_SECONDS", 0.0)
    FakeJob.running, FakeJob.peak = set(), 0
    launcher = launchers.LocalLauncher(max_parallel=max_parallel, submitit_folder=str(tmp_path / "%j"))
    monkeypatch.setattr(launcher, "job_function", lambda: None)
    groups = [[(i, [f"seed={i}"])] for i in range(5)] + [[(5, ["method=a"]), (6, ["method=b"])]]  # a fused group
    outcomes = launcher.run_points(groups, 0)
    assert outcomes == {**{i: ("done", f"seed={i}") for i in range(5)}, 5: ("done", "method=a"),
                        6: ("done", "method=b")}
    assert FakeJob.peak == peak
    assert set(FakeExecutor.gpus_seen) == {()}  # no GPU: none pinned


def test_slurm_point_that_left_the_queue_without_a_result_is_failed(tmp_path, monkeypatch):
    class Gone(FakeJob):
        paths = type("paths", (), {"stderr": tmp_path / "7_0_log.err"})

        def done(self) -> bool:
            return False

    monkeypatch.setattr(launchers, "LEFT_QUEUE_GRACE_SECONDS", 0.0)
    monkeypatch.setattr(status, "slurm_queue", lambda ids: set())
    launcher = launchers.SlurmLauncher(submitit_folder=str(tmp_path / "%j"))
    outcome = launcher.poll({0: Gone(["p"], job_id="7_0")})
    assert outcome[0][0] == "failed" and "SLURM job 7_0 left the queue without a result" in outcome[0][1]
    monkeypatch.setattr(status, "slurm_queue", lambda ids: {"7_0", "8"})
    assert launcher.poll({0: Gone(["p"], job_id="7_0")}) == {}  # still queued: keep waiting


def test_summary_counts_and_exit_status(capsys):
    launchers.summarize([["a=1"], ["a=2"]], [("done", "x"), ("skipped", "finished before")])
    assert "kvbench sweep: 2 points: 1 done, 1 skipped, 0 failed" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        launchers.summarize([["a=1"]], [("failed", "ConfigError: bad")])
    assert stop.value.code == 1 and "failed #0 a=1: ConfigError: bad" in capsys.readouterr().err


def test_timings_are_marked_when_another_run_shared_the_device(tmp_path):
    status.mark(tmp_path, "neighbour", "running", start=time.time(), device_id="cpu")  # alive: this process
    run_dir = runner.run(make_cfg(tmp_path, "method=full"))
    metrics = pd.read_parquet(run_dir / "metrics.parquet")
    assert (metrics["concurrent_runs"] == 1).all()
    assert json.loads((run_dir / "meta.json").read_text())["concurrent_run_ids"] == ["neighbour"]
    status.clear(tmp_path, "neighbour")
    alone = runner.run(make_cfg(tmp_path, "method=full", "seed=3"))
    assert (pd.read_parquet(alone / "metrics.parquet")["concurrent_runs"] == 0).all()


def test_status_shows_the_array_id_scancel_takes(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "10")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    assert status.slurm_job() == {"slurm_job_id": "12", "slurm_job": "10_2"}
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID")
    assert status.slurm_job() == {"slurm_job_id": "12", "slurm_job": "12"}


@pytest.mark.parametrize(("queue", "state"), [("", "stale"), ("42 10_2", "running")])
def test_a_cancelled_point_on_another_node_is_stale(tmp_path, monkeypatch, queue, state):
    """The record comes from another node (its pid means nothing here): the SLURM queue decides."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "squeue"
    if queue:
        fake.write_text(f"#!/bin/sh\necho '{queue}'\n")
    else:
        fake.write_text("#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id specified' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    record = {"run_id": "r1", "state": "running", "host": "node-17", "pid": 1, "slurm_job_id": "42",
              "slurm_job": "10_2", "time": time.time()}
    (tmp_path / "status").mkdir()
    (tmp_path / "status" / "r1.json").write_text(json.dumps(record))
    assert [r["state"] for r in status.run_states(tmp_path)] == [state]
