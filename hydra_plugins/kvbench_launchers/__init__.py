"""Hydra launchers of kvbench sweeps (``conf/hydra/launcher/*.yaml``; Hydra loads launchers only from the
``hydra_plugins`` namespace, hence this package), each ending with a summary of the points done, skipped
and failed (exit status 1 when one failed):

* ``sequential`` (the default under ``-m``): every point in this process, one after the other;
* ``local``: one process per point (submitit's local executor), at most ``max_parallel`` at once (default
  one per visible GPU, one on a machine without GPUs: timings of points sharing a device mean nothing);
* ``slurm``: one SLURM array job (submitit), ``array_parallelism`` points at once.

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
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher

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
    """Hydra's basic launcher (points run in this process, in order) with the summary."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        returns = super().launch(job_overrides, initial_job_idx)
        summarize(job_overrides, [outcome(r) for r in returns])
        return returns


class _SubmititLauncher(BaseSubmititLauncher):
    """The submitit launcher's job function and resources, with kvbench's planning, waiting and summary."""

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self.left_queue: dict[int, float] = {}  # point -> when its job was first seen gone from the queue

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        outcomes = self.plan(job_overrides)
        todo = [(i, list(o)) for i, o in enumerate(job_overrides) if i not in outcomes]
        if todo:
            folder = Path(str(self.params["submitit_folder"])).parent
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o700)  # the pickles in it are code our jobs run
            outcomes.update(self.run_points(todo, initial_job_idx))
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

        while queue or jobs:
            while queue and len(jobs) < limit:
                index, overrides = queue.pop(0)
                gpu = free.pop(0) if free else None
                if gpu is not None:
                    pinned[index] = gpu
                executor.update_parameters(timeout_min=self.params.get("timeout_min", 240),
                                           gpus_per_node=0 if gpu is None else 1,
                                           visible_gpus=() if gpu is None else (gpu,))
                jobs[index] = executor.submit(self, *self.submit_args(index, overrides, initial_job_idx))
            finished = self.poll(jobs)
            for index in finished:
                del jobs[index]
                if index in pinned:
                    free.append(pinned.pop(index))
            outcomes.update(finished)
            if not finished:
                time.sleep(POLL_SECONDS)
        return outcomes


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
        while jobs:
            finished = self.poll(jobs)
            for index in finished:
                del jobs[index]
            outcomes.update(finished)
            if jobs:
                time.sleep(POLL_SECONDS)
        return outcomes
