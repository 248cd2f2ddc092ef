"""Hydra launchers of kvbench sweeps (``conf/hydra/launcher/*.yaml``; Hydra loads launchers only from the
``hydra_plugins`` namespace, hence this package), each ending with a summary of the points done, skipped
and failed (exit status 1 when one failed):

* ``sequential`` (the default under ``-m``): every point in this process, one after the other;
* ``local``: one process per point (submitit's local executor), at most ``max_parallel`` at once (default
  one per visible GPU, one on a machine without GPUs: timings of points sharing a device mean nothing);
* ``slurm``: one SLURM array job (submitit), ``array_parallelism`` points at once.

A point is counted done when its run is published, whatever its job reported afterwards (the results store
decides, as ``kvbench status`` does). A full disk stops launching points (exit 2); Ctrl-C stops the sweep
(exit 130): running points are recorded as interrupted, the rest as not run, and the same command resumes.

The two submitit launchers submit each run once (a budget sweep's full-cache points share one run id) and
not at all when it has finished, and they stop waiting for a point whose job left the SLURM queue without
a result (cancelled, or killed by the node): such a point is reported as failed.

Their ``submitit_folder`` holds pickles that the jobs execute: it must be writable by you alone (the
default is under your home, made 0700); anyone who can write into it can run code as your jobs.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher

log = logging.getLogger("kvbench")
POLL_SECONDS = 2.0
# A job's result pickle can land on a shared filesystem a little after SLURM drops the job from its queue.
LEFT_QUEUE_GRACE_SECONDS = 30.0
# After Ctrl-C, how long running local points get to record themselves as interrupted and exit.
INTERRUPT_GRACE_SECONDS = 10.0
STATES = ("done", "skipped", "failed", "interrupted", "not run", "still running")  # the first three always shown
# The slack between the clock of the host that published a run and this one's (SLURM nodes).
CLOCK_SLACK_SECONDS = 60.0


def outcome(job_return: JobReturn) -> tuple[str, str]:
    """(done | skipped | failed, detail) of one point from what Hydra recorded of it."""
    if job_return.status == JobStatus.COMPLETED:
        value = job_return._return_value  # the task function's return: (state, detail)
        return tuple(value) if isinstance(value, (tuple, list)) and len(value) == 2 else ("done", str(value))
    err = job_return._return_value
    return "failed", f"{type(err).__name__}: {err}"


def disk_full_detail(result: tuple[str, str]) -> bool:
    """Whether a point failed for want of space (its error, maybe from its job's process, says so)."""
    from kvbench.errors import names_disk_full

    return result[0] == "failed" and names_disk_full(result[1])


def summarize(points: Sequence[Sequence[str]], outcomes: Sequence[tuple[str, str]]) -> None:
    """Print the sweep's summary and exit: 130 when Ctrl-C stopped it, 2 when a full disk did, 1 when a point
    failed (its error is in the summary and its log). Each of those ends with one line saying what to do."""
    from kvbench.errors import INTERRUPTED_EXIT

    counts = {state: sum(o[0] == state for o in outcomes) for state in STATES}
    shown = [f"{n} {state}" for state, n in counts.items() if n or state in STATES[:3]]
    lines = [f"kvbench sweep: {len(points)} points: " + ", ".join(shown)]
    for index, (overrides, (state, detail)) in enumerate(zip(points, outcomes)):
        if state in ("failed", "interrupted", "still running"):
            lines.append(f"  {state} #{index} {' '.join(filter_overrides(overrides))}: {detail}")
    full = [i for i, o in enumerate(outcomes) if disk_full_detail(o)]
    resume = "run the same command again to resume (finished points are skipped)"
    if counts["still running"]:
        lines.append(f"kvbench: interrupted (Ctrl-C): {counts['still running']} submitted points still run on SLURM "
                     f"(kvbench status follows them, scancel stops them); once they have ended, {resume}")
        code = INTERRUPTED_EXIT
    elif counts["interrupted"] or (counts["not run"] and not full):
        lines.append(f"kvbench: interrupted (Ctrl-C): {resume}")
        code = INTERRUPTED_EXIT
    elif full:
        lines.append(f"kvbench: error: point #{full[0]} found no space left on device: free space and {resume}")
        code = 2
    else:
        code = 1 if counts["failed"] else 0
    print("\n".join(lines), file=sys.stderr if code else sys.stdout, flush=True)
    if code:
        sys.exit(code)


def settle(launcher, job_overrides: Sequence[Sequence[str]], outcomes: list[tuple[str, str]],
           since: float) -> list[tuple[str, str]]:
    """The outcomes with every point whose run was published during the sweep counted done, whatever its job
    reported (a failure after publishing, an interrupt), as the store and ``kvbench status`` count it."""
    from kvbench import runner, store

    settled = list(outcomes)
    for index, (state, detail) in enumerate(outcomes):
        if state in ("done", "skipped", "not run"):
            continue
        cfg = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(job_overrides[index]))
        root, rid = Path(cfg.results_root), store.run_id(runner.result_config(cfg))
        marker = store.run_dir(root, rid) / store.FINISHED_MARKER
        if store.is_finished(root, rid) and marker.stat().st_mtime >= since - CLOCK_SLACK_SECONDS:
            settled[index] = ("done", f"{store.run_dir(root, rid)} (its job then reported: {detail})")
    return settled


class SequentialLauncher(BasicLauncher):
    """Hydra's basic launcher (points run in this process, in order), one point at a time so that a full disk
    or Ctrl-C stops the sweep with its summary."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from kvbench.errors import disk_full, disk_full_line

        since, returns, outcomes = time.time(), [], []
        try:
            for index, overrides in enumerate(job_overrides):
                returns += super().launch([overrides], initial_job_idx + index)
                outcomes.append(outcome(returns[-1]))
                if disk_full_detail(outcomes[-1]):
                    break
        except KeyboardInterrupt:
            outcomes.append(("interrupted", "Ctrl-C: its run was not published"))
        except Exception as err:  # noqa: BLE001 - Hydra's own writes (the job's .hydra/ files) on a full disk
            full = disk_full(err)
            if full is None:
                raise
            outcomes.append(("failed", disk_full_line(full)))
        outcomes += [("not run", "")] * (len(job_overrides) - len(outcomes))
        summarize(job_overrides, settle(self, job_overrides, outcomes, since))
        return returns


class _SubmititLauncher(BaseSubmititLauncher):
    """The submitit launcher's job function and resources, with kvbench's planning, waiting and summary."""

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self.left_queue: dict[int, float] = {}  # point -> when its job was first seen gone from the queue

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        since = time.time()
        outcomes = self.plan(job_overrides)
        todo = [(i, list(o)) for i, o in enumerate(job_overrides) if i not in outcomes]
        if todo:
            folder = Path(str(self.params["submitit_folder"])).parent
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o700)  # the pickles in it are code our jobs run
            outcomes.update(self.run_points(todo, initial_job_idx))
        ordered = settle(self, job_overrides, [outcomes[i] for i in range(len(job_overrides))], since)
        summarize(job_overrides, ordered)
        return [JobReturn(overrides=list(o), _return_value=v, status=JobStatus.COMPLETED)
                for o, v in zip(job_overrides, ordered)]

    def plan(self, job_overrides: Sequence[Sequence[str]]) -> dict[int, tuple[str, str]]:
        """Points that need no job: a finished run (unless skip_finished=false) or a repeat of an earlier
        point's run id."""
        from kvbench import runner, store

        first_of: dict[str, int] = {}
        outcomes = {}
        roots = set()  # of finished points: their tables are rebuilt if a full disk left them stale
        for index, overrides in enumerate(job_overrides):
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            rid = store.run_id(runner.result_config(cfg))
            if rid in first_of:
                outcomes[index] = ("skipped", f"the same run as #{first_of[rid]}")
            elif cfg.skip_finished and store.is_finished(Path(cfg.results_root), rid):
                outcomes[index] = ("skipped", "finished before")
                roots.add(Path(cfg.results_root))
            first_of.setdefault(rid, index)
        for root in roots:
            store.update_tables(root, only_if_stale=True)
        return outcomes

    def submit_args(self, index: int, overrides: list[str], initial_job_idx: int) -> tuple:
        number = initial_job_idx + index
        log.info("\t#%d : %s", number, " ".join(filter_overrides(overrides)))
        return overrides, "hydra.sweep.dir", number, f"job_id_for_{number}", Singleton.get_state()

    def poll(self, jobs: dict[int, object]) -> dict[int, tuple[str, str]]:
        """Outcomes of the jobs that have finished, or left the SLURM queue without a result, since the
        last poll (without waiting)."""
        from kvbench.status import slurm_queue

        queued = slurm_queue([j.job_id for j in jobs.values()]) if self._EXECUTOR == "slurm" else None
        outcomes = {}
        for index, job in jobs.items():
            if job.done():
                outcomes[index] = self.job_outcome(job)
            elif queued is not None and job.job_id not in queued:
                first_missed = self.left_queue.setdefault(index, time.monotonic())
                if time.monotonic() - first_missed >= LEFT_QUEUE_GRACE_SECONDS:
                    outcomes[index] = ("failed", f"SLURM job {job.job_id} left the queue without a result "
                                                 f"(cancelled or killed); its log: {job.paths.stderr}")
        return outcomes

    @staticmethod
    def job_outcome(job) -> tuple[str, str]:
        try:
            return outcome(job.results()[0])
        except Exception as err:  # noqa: BLE001 - the job's own exception, or submitit's "job failed"
            return "failed", f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"


class LocalLauncher(_SubmititLauncher):
    """One process per point on this machine, at most ``max_parallel`` at once, each pinned to a GPU of its
    own while there are enough."""

    _EXECUTOR = "local"

    def __init__(self, max_parallel: int | None = None, **params) -> None:
        super().__init__(**params)
        self.max_parallel = max_parallel

    def run_points(self, points: list[tuple[int, list[str]]], initial_job_idx: int) -> dict[int, tuple[str, str]]:
        import submitit
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        limit = int(self.max_parallel or max(gpus, 1))
        if limit < 1:
            from kvbench.errors import ConfigError

            raise ConfigError(f"hydra.launcher.max_parallel={self.max_parallel} must be >= 1 (or null)")
        executor = submitit.LocalExecutor(folder=self.params["submitit_folder"])
        free = list(range(gpus))
        pinned: dict[int, int] = {}
        jobs: dict[int, object] = {}
        queue = list(points)
        outcomes: dict[int, tuple[str, str]] = {}
        log.info("kvbench local launcher: %d points, at most %d at once (%d GPUs)", len(points), limit, gpus)
        try:
            while (queue and not any(map(disk_full_detail, outcomes.values()))) or jobs:
                while queue and len(jobs) < limit and not any(map(disk_full_detail, outcomes.values())):
                    index, overrides = queue.pop(0)
                    gpu = free.pop(0) if free else None
                    if gpu is not None:
                        pinned[index] = gpu
                    executor.update_parameters(timeout_min=self.params.get("timeout_min", 240),
                                               gpus_per_node=0 if gpu is None else 1,
                                               visible_gpus=() if gpu is None else (gpu,))
                    with self.controller_stderr():
                        jobs[index] = executor.submit(self, *self.submit_args(index, overrides, initial_job_idx))
                finished = self.poll(jobs)
                for index in finished:
                    del jobs[index]
                    if index in pinned:
                        free.append(pinned.pop(index))
                outcomes.update(finished)
                if not finished:
                    time.sleep(POLL_SECONDS)
        except KeyboardInterrupt:
            outcomes.update(self.interrupt(jobs))
        finally:
            self.remove_literal_job_folder()
        outcomes.update({index: ("not run", "") for index, _ in queue})
        return outcomes

    def interrupt(self, jobs: dict[int, object]) -> dict[int, tuple[str, str]]:
        """Ctrl-C: pass SIGINT on to the running points (a terminal sends it to them too) and give them
        INTERRUPT_GRACE_SECONDS to record themselves as interrupted and exit."""
        for job in jobs.values():
            job.cancel(check=False)  # SIGINT to the job's controller, which passes it on to the run
        deadline = time.monotonic() + INTERRUPT_GRACE_SECONDS
        while any(not job.done() for job in jobs.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return {index: ("interrupted", "Ctrl-C: its run was not published") for index in jobs}

    @contextmanager
    def controller_stderr(self):
        """Point this process's stderr, which a job's controller inherits as it starts, at a log file in
        the submitit folder: the controller prints a traceback when Ctrl-C stops it (its run logs elsewhere)."""
        folder = Path(str(self.params["submitit_folder"])).parent
        sys.stderr.flush()
        saved = os.dup(2)
        with open(folder / "controllers.log", "ab") as log_file:
            os.dup2(log_file.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)

    def remove_literal_job_folder(self) -> None:
        """submitit's local controller creates the folder it is given literally (".../%j") beside the job
        folders it names; it stays empty."""
        literal = Path(str(self.params["submitit_folder"]))
        if "%j" in literal.name and literal.is_dir() and not any(literal.iterdir()):
            literal.rmdir()


class SlurmLauncher(_SubmititLauncher):
    """One SLURM array job of the points (``array_parallelism`` at once)."""

    _EXECUTOR = "slurm"

    def run_points(self, points: list[tuple[int, list[str]]], initial_job_idx: int) -> dict[int, tuple[str, str]]:
        import submitit

        params = dict(self.params)
        executor = submitit.AutoExecutor(cluster="slurm", folder=params.pop("submitit_folder"),
                                         slurm_max_num_timeout=params.pop("max_num_timeout", 0))
        generic = {"timeout_min", "cpus_per_task", "gpus_per_node", "tasks_per_node", "mem_gb", "nodes", "name",
                   "stderr_to_stdout"}
        executor.update_parameters(**{k if k in generic else f"slurm_{k}": v for k, v in params.items()})
        args = [self.submit_args(index, overrides, initial_job_idx) for index, overrides in points]
        jobs = dict(zip((index for index, _ in points), executor.map_array(self, *zip(*args))))
        outcomes: dict[int, tuple[str, str]] = {}
        try:
            while jobs:
                finished = self.poll(jobs)
                for index in finished:
                    del jobs[index]
                outcomes.update(finished)
                if jobs:
                    time.sleep(POLL_SECONDS)
        except KeyboardInterrupt:  # the jobs are the cluster's: they go on, and kvbench status follows them
            outcomes.update({index: ("still running", f"SLURM job {job.job_id}; `scancel {job.job_id}` stops it")
                             for index, job in jobs.items()})
        return outcomes
