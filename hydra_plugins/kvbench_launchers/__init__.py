"""Hydra launchers of kvbench sweeps (``conf/hydra/launcher/*.yaml``; Hydra loads launchers only from the
``hydra_plugins`` namespace, hence this package), each ending with a summary of the points done, skipped
and failed (exit status 1 when one failed):

* ``sequential`` (the default under ``-m``): every point in this process, one after the other;
* ``local``: one process per point or fused group (submitit's local executor), at most ``max_parallel`` at
  once (default one per visible GPU, one on a machine without GPUs: timings of points sharing a device mean
  nothing);
* ``slurm``: one SLURM array job (submitit), one task per point or fused group, ``array_parallelism`` at once.

A point is counted done when its run is published, whatever its job reported afterwards (the results store
decides, as ``kvbench status`` does). A full disk stops launching points (exit 2); Ctrl-C stops the sweep
(exit 130): running points are recorded as interrupted, the rest as not run, and the same command resumes.

Points that can share each sample's prompt pass (``kvbench.sweep``) run as one fused group: one run of the
sequential launcher, one process of the local one, one SLURM array task; ``sweep.fuse=false`` runs every
point alone; ``sweep.memory_gb`` caps what a group holds in prefilled rows.

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
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, setup_globals
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from hydra_plugins.kvbench_launchers import fused

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
    """Hydra's basic launcher (points run in this process, in order), one group of points at a time (a fused
    group runs together) so that a full disk or Ctrl-C stops the sweep with its summary."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from kvbench.errors import disk_full, disk_full_line

        setup_globals()
        since = time.time()
        returns: list[JobReturn | None] = [None] * len(job_overrides)
        outcomes: list[tuple[str, str] | None] = [None] * len(job_overrides)
        group: list[int] = []
        try:
            for group in fused.groups(self.hydra_context, self.config, job_overrides, list(range(len(job_overrides)))):
                for i, job_return in zip(group, self.launch_group(job_overrides, group, initial_job_idx)):
                    returns[i], outcomes[i] = job_return, outcome(job_return)
                if any(disk_full_detail(outcomes[i]) for i in group):
                    break
        except KeyboardInterrupt:
            for i in group:
                outcomes[i] = outcomes[i] or ("interrupted", "Ctrl-C: its run was not published")
        except Exception as err:  # noqa: BLE001 - Hydra's own writes (the job's .hydra/ files) on a full disk
            full = disk_full(err)
            if full is None:
                raise
            for i in group:
                outcomes[i] = outcomes[i] or ("failed", disk_full_line(full))
        outcomes = [o or ("not run", "") for o in outcomes]
        summarize(job_overrides, settle(self, job_overrides, outcomes, since))
        return [r for r in returns if r is not None]

    def launch_group(self, job_overrides: Sequence[Sequence[str]], group: list[int],
                     initial_job_idx: int) -> Sequence[JobReturn]:
        """Run the points ``group`` (indices into ``job_overrides``): one point as Hydra's basic launcher runs it,
        several as one fused group (``fused.run_group``)."""
        if len(group) == 1:
            return super().launch([job_overrides[group[0]]], initial_job_idx + group[0])
        return fused.run_group(self.hydra_context, self.config,
                               [(initial_job_idx + i, list(job_overrides[i])) for i in group])


class _SubmititLauncher(BaseSubmititLauncher):
    """The submitit launcher's resources, with kvbench's planning, waiting and summary. Every job runs a group
    of points (``fused.GroupJob``; one point when it shares its prompt passes with none)."""

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self.left_queue: dict[int, float] = {}  # job (its first point) -> when first seen gone from the queue
        self.members: dict[int, list[int]] = {}  # job (its first point) -> every point it runs

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        since = time.time()
        outcomes = self.plan(job_overrides)
        todo = [i for i in range(len(job_overrides)) if i not in outcomes]
        if todo:
            folder = Path(str(self.params["submitit_folder"])).parent
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o700)  # the pickles in it are code our jobs run
            groups = fused.groups(self.hydra_context, self.config, job_overrides, todo)
            outcomes.update(self.run_points([[(i, list(job_overrides[i])) for i in group] for group in groups],
                                            initial_job_idx))
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

    def job_function(self) -> fused.GroupJob:
        return fused.GroupJob(self.hydra_context, self.config)

    def submit_args(self, group: list[tuple[int, list[str]]], initial_job_idx: int) -> tuple:
        """The job function's arguments for a group of (point, overrides); registers the job's points."""
        numbered = [(initial_job_idx + index, overrides) for index, overrides in group]
        for number, overrides in numbered:
            log.info("\t#%d : %s", number, " ".join(filter_overrides(overrides)))
        self.members[group[0][0]] = [index for index, _ in group]
        return numbered, Singleton.get_state()

    def poll(self, jobs: dict[int, object]) -> dict[int, tuple[str, str]]:
        """Outcomes of the points whose jobs have finished, or left the SLURM queue without a result, since the
        last poll (without waiting). ``jobs``: job by its first point."""
        from kvbench.status import slurm_queue

        queued = slurm_queue([j.job_id for j in jobs.values()]) if self._EXECUTOR == "slurm" else None
        outcomes = {}
        for first, job in jobs.items():
            members = self.members.get(first, [first])
            if job.done():
                outcomes.update(zip(members, self.job_outcomes(job, len(members))))
            elif queued is not None and job.job_id not in queued:
                first_missed = self.left_queue.setdefault(first, time.monotonic())
                if time.monotonic() - first_missed >= LEFT_QUEUE_GRACE_SECONDS:
                    outcomes.update((index, ("failed", f"SLURM job {job.job_id} left the queue without a result "
                                                       f"(cancelled or killed); its log: {job.paths.stderr}"))
                                    for index in members)
        return outcomes

    @staticmethod
    def job_outcomes(job, points: int) -> list[tuple[str, str]]:
        """The outcome of each of the job's ``points``."""
        try:
            return [outcome(job_return) for job_return in job.results()[0]]
        except Exception as err:  # noqa: BLE001 - the job's own exception, or submitit's "job failed"
            text = str(err).strip()
            return [("failed", f"{type(err).__name__}: {text.splitlines()[-1] if text else ''}")] * points


class LocalLauncher(_SubmititLauncher):
    """One process per point or fused group on this machine, at most ``max_parallel`` at once, each pinned to
    a GPU of its own while there are enough."""

    _EXECUTOR = "local"

    def __init__(self, max_parallel: int | None = None, **params) -> None:
        super().__init__(**params)
        self.max_parallel = max_parallel

    def run_points(self, groups: list[list[tuple[int, list[str]]]], initial_job_idx: int) -> dict[int, tuple[str, str]]:
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
        jobs: dict[int, object] = {}  # by the group's first point
        queue = list(groups)
        outcomes: dict[int, tuple[str, str]] = {}
        log.info("kvbench local launcher: %d jobs, at most %d at once (%d GPUs)", len(groups), limit, gpus)
        try:
            while (queue and not any(map(disk_full_detail, outcomes.values()))) or jobs:
                while queue and len(jobs) < limit and not any(map(disk_full_detail, outcomes.values())):
                    group = queue.pop(0)
                    first = group[0][0]
                    gpu = free.pop(0) if free else None
                    if gpu is not None:
                        pinned[first] = gpu
                    executor.update_parameters(timeout_min=self.params.get("timeout_min", 240),
                                               gpus_per_node=0 if gpu is None else 1,
                                               visible_gpus=() if gpu is None else (gpu,))
                    with self.controller_stderr():
                        jobs[first] = executor.submit(self.job_function(), *self.submit_args(group, initial_job_idx))
                finished = self.poll(jobs)
                for first in [first for first in jobs if first in finished]:
                    del jobs[first]
                    if first in pinned:
                        free.append(pinned.pop(first))
                outcomes.update(finished)
                if not finished:
                    time.sleep(POLL_SECONDS)
        except KeyboardInterrupt:
            outcomes.update(self.interrupt(jobs))
        finally:
            self.remove_literal_job_folder()
        outcomes.update({index: ("not run", "") for group in queue for index, _ in group})
        return outcomes

    def interrupt(self, jobs: dict[int, object]) -> dict[int, tuple[str, str]]:
        """Ctrl-C: pass SIGINT on to the running points (a terminal sends it to them too) and give them
        INTERRUPT_GRACE_SECONDS to record themselves as interrupted and exit."""
        for job in jobs.values():
            job.cancel(check=False)  # SIGINT to the job's controller, which passes it on to the run
        deadline = time.monotonic() + INTERRUPT_GRACE_SECONDS
        while any(not job.done() for job in jobs.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return {index: ("interrupted", "Ctrl-C: its run was not published")
                for first in jobs for index in self.members.get(first, [first])}

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
    """One SLURM array job, one task per group of points (``array_parallelism`` at once)."""

    _EXECUTOR = "slurm"

    def run_points(self, groups: list[list[tuple[int, list[str]]]], initial_job_idx: int) -> dict[int, tuple[str, str]]:
        import submitit

        params = dict(self.params)
        executor = submitit.AutoExecutor(cluster="slurm", folder=params.pop("submitit_folder"),
                                         slurm_max_num_timeout=params.pop("max_num_timeout", 0))
        generic = {"timeout_min", "cpus_per_task", "gpus_per_node", "tasks_per_node", "mem_gb", "nodes", "name",
                   "stderr_to_stdout"}
        executor.update_parameters(**{k if k in generic else f"slurm_{k}": v for k, v in params.items()})
        args = [self.submit_args(group, initial_job_idx) for group in groups]
        jobs = dict(zip((group[0][0] for group in groups), executor.map_array(self.job_function(), *zip(*args))))
        outcomes: dict[int, tuple[str, str]] = {}
        try:
            while jobs:
                finished = self.poll(jobs)
                for first in [first for first in jobs if first in finished]:
                    del jobs[first]
                outcomes.update(finished)
                if jobs:
                    time.sleep(POLL_SECONDS)
        except KeyboardInterrupt:  # the jobs are the cluster's: they go on, and kvbench status follows them
            outcomes.update({index: ("still running", f"SLURM job {job.job_id}; `scancel {job.job_id}` stops it")
                             for first, job in jobs.items() for index in self.members.get(first, [first])})
        return outcomes
