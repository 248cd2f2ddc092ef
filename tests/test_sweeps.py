"""Sweeps: the launchers' summary, one full-cache run per budget sweep, a failing point that does not stop
(or hang) the sweep, data checked before any point launches, Ctrl-C (one line, the summary, the run recorded
as interrupted, the same command resumes), the local launcher's concurrency cap and its submitit folder,
timings marked when runs shared a device, and SLURM points that left the queue. Real SLURM is in
test_slurm.py; full disks in test_faults.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from hydra.core.utils import JobReturn, JobStatus

from hydra_plugins import kvbench_launchers as launchers
from kvbench import runner, status, store
from kvbench.tasks.base import Task
from tests.conftest import REPO, kvbench_command, pythonpath_with_repo
from tests.test_runner import make_cfg

RESUME = "kvbench: interrupted (Ctrl-C): run the same command again to resume (finished points are skipped)"
PASSKEY = ["model=tiny-llama-random", "task=passkey", "task.context_lengths=[128]", "task.depths=[0]"]


def sweep(args: list[str], monkeypatch) -> tuple[int, str, str]:
    """``kvbench -m ARGS`` in this process (the sequential launcher): (exit status, stdout, stderr)."""
    return kvbench_command(["-m", *args], monkeypatch)


def test_full_cache_runs_once_in_a_budget_sweep(tmp_path, monkeypatch):
    code, out, _ = sweep([*PASSKEY, "method=full,streamingllm", "budget=0.2,0.5", f"results_root={tmp_path}"],
                         monkeypatch)
    assert code == 0
    assert "kvbench sweep: 4 points: 3 done, 1 skipped, 0 failed" in out
    metrics = pd.read_parquet(tmp_path / "metrics.parquet")
    assert sorted(set(zip(metrics["method"], metrics["budget"]))) == [("full", "full"), ("streamingllm", "0.2"),
                                                                      ("streamingllm", "0.5")]


def test_a_failing_point_is_reported_and_the_sweep_goes_on(tmp_path, monkeypatch):
    """A point that fails as it runs (its prompt does not fit the model): the others still run."""
    args = [*PASSKEY, "method=full", "model.max_length=100,4096", f"results_root={tmp_path / 'results'}"]
    code, _, err = sweep(args, monkeypatch)
    assert code == 1
    assert "kvbench sweep: 2 points: 1 done, 0 skipped, 1 failed" in err
    assert "failed #0 model=tiny-llama-random" in err and "has max_length=100" in err
    assert len(store.finished_runs(tmp_path / "results")) == 1


def test_data_are_checked_before_any_point_launches(tmp_path, monkeypatch):
    """Issue 24, case 6: a data problem is one line and exit 2, and no point is launched."""
    root = tmp_path / "results"
    args = ["model=tiny-llama-random", "method=h2o,snapkv,tova", "task=longbench", "task.source=local",
            f"task.data_dir={tmp_path / 'nonexistent' / 'lb'}", "limit=1", f"results_root={root}"]
    code, out, err = sweep(args, monkeypatch)
    assert code == 2 and err.splitlines() == [
        "kvbench: error: THUDM/LongBench 'narrativeqa' (test): none of ['narrativeqa.jsonl', 'narrativeqa.parquet', "
        "'narrativeqa.json', 'data/narrativeqa.jsonl', 'data/narrativeqa.parquet', 'data/narrativeqa.json'] found in "
        f"{tmp_path / 'nonexistent' / 'lb'}"]
    assert not root.exists() or not any(root.iterdir())  # no Hydra folder, no status record: nothing launched


def interrupt_at(method: str, monkeypatch) -> None:
    """Ctrl-C while ``method``'s run generates."""
    predict = Task.predict

    def predict_or_interrupt(self, samples, lm, engine):
        if engine.method.name == method:
            raise KeyboardInterrupt
        return predict(self, samples, lm, engine)

    monkeypatch.setattr(Task, "predict", predict_or_interrupt)


def test_ctrl_c_stops_a_sweep_with_its_summary_and_the_same_command_resumes(tmp_path, monkeypatch):
    """Issue 24, case 7 (the sequential launcher; the local one below): one line and the summary, no
    traceback, exit 130; the run in progress is recorded as interrupted, with the command that re-runs it.
    Points run alone (a fused group's Ctrl-C is in test_fused_sweeps.py)."""
    args = [*PASSKEY, "method=full,h2o,snapkv", "sweep.fuse=false", f"results_root={tmp_path}"]
    interrupt_at("h2o", monkeypatch)
    code, _, err = sweep(args, monkeypatch)
    lines = err.strip().splitlines()
    assert code == 130 and not any("Traceback" in line for line in lines), err
    assert "kvbench sweep: 3 points: 1 done, 0 skipped, 0 failed, 1 interrupted, 1 not run" in lines
    assert lines[-1] == RESUME
    records = {r["method"]: r for r in status.run_states(tmp_path)}
    assert {m: r["state"] for m, r in records.items()} == {"full": "done", "h2o": "interrupted"}
    assert records["h2o"]["error"] == "interrupted (Ctrl-C or SIGINT) before it was published"
    assert status.what_to_do(tmp_path, records["h2o"]) == (
        "run it again: python -m kvbench model=tiny-llama-random task=passkey 'task.context_lengths=[128]' "
        f"'task.depths=[0]' method=h2o sweep.fuse=False results_root={tmp_path}")
    monkeypatch.undo()
    code, out, _ = sweep(args, monkeypatch)
    assert code == 0 and "kvbench sweep: 3 points: 2 done, 1 skipped, 0 failed" in out
    assert {r["state"] for r in status.run_states(tmp_path)} == {"done"}


def test_ctrl_c_on_a_single_run_is_one_line(tmp_path, monkeypatch):
    interrupt_at("h2o", monkeypatch)
    code, _, err = kvbench_command([*PASSKEY, "method=h2o", f"results_root={tmp_path}"], monkeypatch)
    assert code == 130 and err.splitlines() == [
        "kvbench: interrupted (Ctrl-C): the run in progress was not published (kvbench status shows it as "
        "interrupted); run the same command again to resume"]
    assert [r["state"] for r in status.run_states(tmp_path)] == ["interrupted"]


def test_a_point_failing_under_a_launcher_returns_a_result_instead_of_exiting(tmp_path, monkeypatch):
    """Under a sweep the job function returns ("failed", error): a SLURM job then writes its result pickle
    (sys.exit would leave none, and the launcher would wait for ever)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from kvbench.__main__ import main

    class Sweep:
        mode = RunMode.MULTIRUN
        runtime = type("runtime", (), {"output_dir": str(tmp_path / "out")})
        overrides = type("overrides", (), {"task": ["method=full"]})

    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: Sweep))
    cfg = make_cfg(tmp_path, "method=full", "task.context_lengths=[10]")
    assert main.__wrapped__(cfg) == ("failed", "ConfigError: passkey.context_lengths=[10]: each must be >= 64 tokens")


class FakeJob:
    """A submitit job of a group of points that finishes after ``polls`` calls of done()."""

    running: set = set()
    cancelled: list = []
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

    def cancel(self, check: bool = True) -> None:
        FakeJob.cancelled.append(self.name)
        FakeJob.running.discard(self.name)
        self.polls = 0


class FakeExecutor:
    gpus_seen: list = []

    def __init__(self, folder) -> None:
        self.parameters = {}
        Path(folder).mkdir(parents=True, exist_ok=True)  # as submitit's local controller does, literally

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


def test_ctrl_c_on_the_local_launcher_interrupts_its_points_and_leaves_no_literal_job_folder(tmp_path, monkeypatch):
    """Issue 24, cases 7 and 8: the running job is passed the Ctrl-C and its points (a fused group) counted
    interrupted, the queued ones not run; the empty ".../%j" folder submitit's controller makes is removed."""
    import submitit
    import torch

    monkeypatch.setattr(submitit, "LocalExecutor", FakeExecutor)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(launchers, "POLL_SECONDS", 0.0)
    FakeJob.running, FakeJob.cancelled = set(), []
    launcher = launchers.LocalLauncher(submitit_folder=str(tmp_path / "submitit" / "%j"))
    monkeypatch.setattr(launcher, "job_function", lambda: None)
    poll = launcher.poll
    calls = []

    def poll_until_ctrl_c(jobs):
        calls.append(1)
        if len(calls) == 4:  # point 0 has finished (3 polls), point 1 runs
            raise KeyboardInterrupt
        return poll(jobs)

    monkeypatch.setattr(launcher, "poll", poll_until_ctrl_c)
    groups = [[(0, ["seed=0"])], [(1, ["method=a"]), (2, ["method=b"])], [(3, ["seed=3"])]]  # one fused group
    outcomes = launcher.run_points(groups, 0)
    interrupted = ("interrupted", "Ctrl-C: its run was not published")
    assert outcomes == {0: ("done", "seed=0"), 1: interrupted, 2: interrupted, 3: ("not run", "")}
    assert FakeJob.cancelled == ["method=a method=b"]
    assert [p.name for p in (tmp_path / "submitit").iterdir()] == ["controllers.log"]


def test_a_job_controller_writes_its_stderr_to_a_log_not_to_the_terminal(tmp_path, capfd):
    """What submitit's local controller prints when Ctrl-C stops it (a traceback) goes to a log file."""
    launcher = launchers.LocalLauncher(submitit_folder=str(tmp_path / "%j"))
    with launcher.controller_stderr():
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stderr.write('controller traceback')"])
    child.wait()
    assert "controller traceback" not in capfd.readouterr().err
    assert (tmp_path / "controllers.log").read_text() == "controller traceback"


@pytest.mark.slow
def test_ctrl_c_in_a_terminal_on_a_local_sweep(tmp_path):
    """Issue 24, case 7, as a terminal does it: SIGINT to the process group of ``kvbench -m
    hydra/launcher=local ...`` (the launcher, the job's controller and its run) while a point runs (both
    points, one fused group, in one job)."""
    root, folder = tmp_path / "results", tmp_path / "submitit"
    env = {**os.environ, "PYTHONPATH": pythonpath_with_repo(), "KVBENCH_SUBMITIT_DIR": str(folder)}
    args = ["model=tiny-llama-random", "task=passkey", "task.context_lengths=[2048]", "method=h2o,snapkv",
            "task.depths=[0,10,20,30,40,50,60,70,80,90,100]", f"results_root={root}"]
    sweep_ = subprocess.Popen([sys.executable, "-m", "kvbench", "-m", "hydra/launcher=local", *args], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True,  # its own process group, as a terminal's job
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    while not [r for r in status.run_states(root) if r["state"] == "running"] and time.monotonic() < deadline:
        time.sleep(0.5)
    os.killpg(sweep_.pid, signal.SIGINT)
    output, _ = sweep_.communicate(timeout=120)
    assert sweep_.returncode == 130 and "Traceback" not in output, output
    lines = output.strip().splitlines()
    assert "kvbench sweep: 2 points: 0 done, 0 skipped, 0 failed, 2 interrupted" in lines, output  # one fused group
    assert lines[-1] == RESUME
    assert sorted((r["state"], r["method"]) for r in status.run_states(root)) == [("interrupted", "h2o"),
                                                                                ("interrupted", "snapkv")]
    assert "%j" not in [p.name for p in folder.iterdir()]


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
