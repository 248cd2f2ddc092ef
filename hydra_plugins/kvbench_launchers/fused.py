"""A fused group of sweep points (``kvbench.sweep``) as one Hydra job: each point gets its Hydra job dir and
saved config as Hydra's ``run_job`` makes them (callbacks included), then the group runs in this process."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, run_job, setup_globals
from hydra.types import HydraContext
from omegaconf import DictConfig, OmegaConf, open_dict


def groups(hydra_context: HydraContext, config: DictConfig, job_overrides: Sequence[Sequence[str]],
           indices: list[int]) -> list[list[int]]:
    """``indices`` of sweep points in the groups that share prompt passes (``kvbench.sweep.group_points``);
    one point per group when the sweep's ``sweep.fuse`` is off."""
    if not config.sweep.fuse:
        return [[index] for index in indices]
    from kvbench import sweep

    cfgs = [hydra_context.config_loader.load_sweep_config(config, list(job_overrides[i])) for i in indices]
    return [[indices[j] for j in group] for group in sweep.group_points(cfgs)]


def run_group(hydra_context: HydraContext, config: DictConfig, points: list[tuple[int, list[str]]],
              job_id: str | None = None) -> list[JobReturn]:
    """Run the group of ``points`` (job number, overrides) in this process; one ``JobReturn`` per point whose
    value is its outcome (done | skipped | failed, detail). ``job_id``: the scheduler's, else the job number."""
    from kvbench import sweep

    returns = []
    for number, overrides in points:
        sweep_config = hydra_context.config_loader.load_sweep_config(config, list(overrides))
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = number if job_id is None else job_id
            sweep_config.hydra.job.num = number
        returns.append(run_job(hydra_context=hydra_context, task_function=_resolved_point, config=sweep_config,
                               job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir"))
    ready = [r for r in returns if r.status == JobStatus.COMPLETED]  # a failing callback fails its point
    for job_return, outcome in zip(ready, sweep.run_group([r.return_value for r in ready], config.sweep.memory_gb)):
        job_return.return_value = outcome
    return returns


def _resolved_point(cfg: DictConfig) -> tuple[DictConfig, Path, list[str]]:
    """The point's config resolved while its Hydra config is the current one, its job dir and its command-line
    overrides (``kvbench status`` names them in the command that re-runs it)."""
    OmegaConf.resolve(cfg)
    hydra = HydraConfig.get()
    logger = cfg.get("logger")
    if logger is not None and logger.get("name") == "wandb" and not logger.get("group"):
        from kvbench.wandb_tracker import sweep_group

        with open_dict(cfg):  # the sweep's W&B group, named now: the group runs when no Hydra job is current
            logger.group = sweep_group()
    return cfg, Path(hydra.runtime.output_dir), list(hydra.overrides.task)


class GroupJob:
    """A fused group as one submitit job (a SLURM array task, or a local process)."""

    def __init__(self, hydra_context: HydraContext, config: DictConfig) -> None:
        self.hydra_context, self.config = hydra_context, config

    def __call__(self, points: list[tuple[int, list[str]]], singleton_state: dict) -> list[JobReturn]:
        import submitit

        Singleton.set_state(singleton_state)
        setup_globals()
        return run_group(self.hydra_context, self.config, points, job_id=submitit.JobEnvironment().job_id)

    def checkpoint(self, *args):
        """Requeued on timeout or preemption with the same points: the finished ones skip."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args)
