"""Hydra launchers of kvbench sweeps (``conf/hydra/launcher/*.yaml``; Hydra loads launchers only from the
``hydra_plugins`` namespace, hence this package), each ending with a summary of the points done, skipped
and failed (exit status 1 when one failed):

* ``sequential`` (the default under ``-m``): every point in this process, one after the other;
* ``local``: one process per point (submitit's local executor), at most ``max_parallel`` at once (default
  one per visible GPU, one on a machine without GPUs: timings of points sharing a device mean nothing);
* ``slurm``: one SLURM array job (submitit), ``array_parallelism`` points at once.

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


def outcome(job_return: JobReturn) -> tuple[str, str]:
    """(done | skipped | failed, detail) of one point from what Hydra recorded of it."""
    if job_return.status == JobStatus.COMPLETED:
        value = job_return._return_value  # the task function's return: (state, detail)
        return tuple(value) if isinstance(value, (tuple, list)) and len(value) == 2 else ("done", str(value))
    err = job_return._return_value
    return "failed", f"{type(err).__name__}: {err}"


def summarize(points: Sequence[Sequence[str]], outcomes: Sequence[tuple[str, str]]) -> None:
    """Print the sweep's summary; exit 1 when a point failed (its error is in the summary and its log)."""
    counts = {state: sum(o[0] == state for o in outcomes) for state in ("done", "skipped", "failed")}
    lines = [f"kvbench sweep: {len(points)} points: " + ", ".join(f"{n} {s}" for s, n in counts.items())]
    for index, (overrides, (state, detail)) in enumerate(zip(points, outcomes)):
        if state == "failed":
            lines.append(f"  failed #{index} {' '.join(filter_overrides(overrides))}: {detail}")
    print("\n".join(lines), file=sys.stderr if counts["failed"] else sys.stdout, flush=True)
    if counts["failed"]:
        sys.exit(1)


class SequentialLauncher(BasicLauncher):
    """Hydra's basic launcher (points run in this process, in order) with the summary; the points of a fused
    group run together."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        returns: list[JobReturn | None] = [None] * len(job_overrides)
        for group in fused.groups(self.hydra_context, self.config, job_overrides, list(range(len(job_overrides)))):
            if len(group) == 1:
                returns[group[0]] = super().launch([job_overrides[group[0]]], initial_job_idx + group[0])[0]
                continue
            points = [(initial_job_idx + i, list(job_overrides[i])) for i in group]
            for i, job_return in zip(group, fused.run_group(self.hydra_context, self.config, points)):
                returns[i] = job_return
        summarize(job_overrides, [outcome(r) for r in returns])
        return returns


class _SubmititLauncher(BaseSubmititLauncher):
    """The submitit launcher's resources, with kvbench's planning, waiting and summary. Every job runs a group
    of points (``fused.GroupJob``; one point when it shares its prompt passes with none)."""

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self.left_queue: dict[int, float] = {}  # job (its first point) -> when first seen gone from the queue
        self.members: dict[int, list[int]] = {}  # job (its first point) -> every point it runs

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        outcomes = self.plan(job_overrides)
        todo = [i for i in range(len(job_overrides)) if i not in outcomes]
        if todo:
            folder = Path(str(self.params["submitit_folder"])).parent
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o700)  # the pickles in it are code our jobs run
            groups = fused.groups(self.hydra_context, self.config, job_overrides, todo)
            outcomes.update(self.run_points([[(i, list(job_overrides[i])) for i in group] for group in groups],
                                            initial_job_idx))
        ordered = [outcomes[i] for i in range(len(job_overrides))]
        summarize(job_overrides, ordered)
        return [JobReturn(overrides=list(o), _return_value=v, status=JobStatus.COMPLETED)
                for o, v in zip(job_overrides, ordered)]

    def plan(self, job_overrides: Sequence[Sequence[str]]) -> dict[int, tuple[str, str]]:
        """Points that need no job: a finished run (unless skip_finished=false) or a repeat of an earlier
        point's run id."""
        from kvbench import runner, store

        first_of: dict[str, int] = {}
        outcomes = {}
        for index, overrides in enumerate(job_overrides):
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            rid = store.run_id(runner.result_config(cfg))
            if rid in first_of:
                outcomes[index] = ("skipped", f"the same run as #{first_of[rid]}")
            elif cfg.skip_finished and store.is_finished(Path(cfg.results_root), rid):
                outcomes[index] = ("skipped", "finished before")
            first_of.setdefault(rid, index)
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
    """One process per point on this machine, at most ``max_parallel`` at once, each pinned to a GPU of its
    own while there are enough."""

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

        while queue or jobs:
            while queue and len(jobs) < limit:
                group = queue.pop(0)
                first = group[0][0]
                gpu = free.pop(0) if free else None
                if gpu is not None:
                    pinned[first] = gpu
                executor.update_parameters(timeout_min=self.params.get("timeout_min", 240),
                                           gpus_per_node=0 if gpu is None else 1,
                                           visible_gpus=() if gpu is None else (gpu,))
                jobs[first] = executor.submit(self.job_function(), *self.submit_args(group, initial_job_idx))
            finished = self.poll(jobs)
            for first in [first for first in jobs if first in finished]:
                del jobs[first]
                if first in pinned:
                    free.append(pinned.pop(first))
            outcomes.update(finished)
            if not finished:
                time.sleep(POLL_SECONDS)
        return outcomes


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
        while jobs:
            finished = self.poll(jobs)
            for first in [first for first in jobs if first in finished]:
                del jobs[first]
            outcomes.update(finished)
            if jobs:
                time.sleep(POLL_SECONDS)
        return outcomes
