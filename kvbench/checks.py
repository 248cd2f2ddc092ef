"""Checks of one composed run config before anything runs or is submitted: every bad value gets one line
naming it and the accepted ones (``ConfigError``), and nothing is written that looks finished.

``python -m kvbench`` runs ``validate`` on the run, or on every point of a sweep before launching any, and
``check_data`` on every task a sweep reads; ``runner.run`` runs ``validate`` again (programmatic use).
Problems that only the data reveal (a missing or corrupt file, no samples) are raised by the tasks when they
load: before the first point of a sweep, or when a single run loads them."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import types
import typing
from pathlib import Path

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from kvbench.errors import ConfigError, unknown_name

GROUPS = ("model", "method", "budget", "task", "logger", "kernels")
BASES = {"method": ("kvbench.methods.base", "Method"), "task": ("kvbench.tasks.base", "Task")}  # group -> class


def validate(cfg: DictConfig) -> None:
    """Every check of one run config, in the order the config reads."""
    check_top_level(cfg)
    build("method", cfg.method)
    check_budget(cfg.budget)
    task = build("task", cfg.task)
    if cfg.batch_size == "auto" and task.lockstep_batches:
        raise ConfigError(f"batch_size=auto with task={task.name}: it decodes a batch in lockstep; accepted: an "
                          "integer >= 1")
    check_model(cfg.model)
    check_logger(cfg.logger)
    check_kernels(cfg.kernels)
    check_results_root(cfg.results_root)


def check_top_level(cfg: DictConfig) -> None:
    from kvbench.engine import POSITION_MODES

    _expect("seed", cfg.seed, int)
    if cfg.batch_size != "auto" and (not _matches(cfg.batch_size, int) or cfg.batch_size < 1):
        raise ConfigError(f"batch_size={cfg.batch_size!r}; accepted: an integer >= 1 or auto")
    if cfg.engine.cuda_graphs not in (True, False, "auto"):
        raise ConfigError(f"engine.cuda_graphs={cfg.engine.cuda_graphs!r}; accepted: true, false, auto")
    _expect("limit", cfg.limit, int | None)
    if cfg.limit is not None and cfg.limit < 1:
        raise ConfigError(f"limit={cfg.limit} must be a positive number of samples, or null for all of them")
    if cfg.position_mode not in POSITION_MODES:
        raise unknown_name("position_mode", cfg.position_mode, POSITION_MODES)
    _expect("skip_finished", cfg.skip_finished, bool)
    _expect("sweep.fuse", cfg.sweep.fuse, bool)
    _expect("sweep.memory_gb", cfg.sweep.memory_gb, float | None)
    if cfg.sweep.memory_gb is not None and cfg.sweep.memory_gb <= 0:
        raise ConfigError(f"sweep.memory_gb={cfg.sweep.memory_gb} must be > 0 GiB, or null for 0.8 of the free memory")


def fields_of(group: str, node: DictConfig) -> tuple[type, dict[str, object]]:
    """The class a ``method``/``task`` config builds and its constructor fields with their types. Its
    ``_target_`` must name a dataclass subclassing kvbench's Method / Task."""
    target = node.get("_target_")
    module_name, _, attribute = str(target).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as err:  # ValueError: no module part
        raise ConfigError(f"{group}._target_='{target}' cannot be imported ({type(err).__name__}); "
                          f"{_accepted_targets(group)}") from None
    module, name = BASES[group]
    base = getattr(__import__(module, fromlist=[name]), name)
    if not isinstance(cls, type):
        problem = f"is a {type(cls).__name__}, not a class"
    elif not issubclass(cls, base):
        problem = f"is not a subclass of {module}.{name}"
    else:
        problem = "" if dataclasses.is_dataclass(cls) else "is not a dataclass"
    if problem:
        raise ConfigError(f"{group}._target_='{target}' {problem}; {_accepted_targets(group)}")
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an annotation naming a type-checking-only import: types unchecked
        hints = {}
    return cls, {f.name: hints.get(f.name, typing.Any) for f in dataclasses.fields(cls) if f.init}


def _accepted_targets(group: str) -> str:
    from kvbench.cli import CONF

    module, name = BASES[group]
    choices = ", ".join(sorted(p.stem for p in (CONF / group).glob("*.yaml")))
    return f"accepted: a {module}.{name} dataclass, as the {group} choices name ({group}=NAME: {choices})"


def build(group: str, node: DictConfig):
    """Check a ``method``/``task`` config's keys and value types against its class, then build it (its own
    checks run in ``__post_init__``)."""
    cls, fields = fields_of(group, node)
    values = OmegaConf.to_container(node, resolve=True)
    values.pop("_target_", None)
    name = getattr(cls, "name", group)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key {group}.{unknown[0]} for {group} {name}; accepted: {', '.join(sorted(fields))}")
    for key, value in values.items():
        _expect(f"{group}.{key}", value, fields[key])
    return cls(**values)  # directly: Hydra's instantiate costs 10x more, on every point of a sweep


def task_samples(task) -> list:
    """The task's samples; none is an error naming the task."""
    samples = task.samples()
    if not samples:
        raise ConfigError(f"task '{task.name}' produced no samples; check its data and task.* settings")
    return samples


def check_data(points: list[DictConfig]) -> None:
    """Load the samples of every distinct task config of a sweep (data files, the hub's files) before any
    point launches: a data problem is then one line, exit 2, with nothing launched."""
    seen = set()
    for cfg in points:
        key = json.dumps(OmegaConf.to_container(cfg.task, resolve=True), sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            task_samples(build("task", cfg.task))


def instantiate_config(node):
    """hydra's instantiate, with a ConfigError raised by the target's validation passed through unwrapped
    (Hydra wraps it in a multi-line InstantiationException)."""
    try:
        return instantiate(node)
    except InstantiationException as err:
        cause = err.__cause__ or err.__context__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise


def check_budget(node: DictConfig) -> None:
    from kvbench.budget import Budget

    _expect("budget.value", node.value, float)
    Budget(kind=node.kind, value=node.value)


def check_model(node: DictConfig) -> None:
    import torch

    from kvbench.attention import BASE_IMPLEMENTATIONS
    from kvbench.models import DTYPES, SOURCES

    if node.source not in SOURCES:
        raise unknown_name("model.source", node.source, SOURCES)
    if node.dtype not in DTYPES:
        raise unknown_name("model.dtype", node.dtype, DTYPES)
    if node.attn_implementation not in BASE_IMPLEMENTATIONS:
        raise unknown_name("model.attn_implementation", node.attn_implementation, BASE_IMPLEMENTATIONS)
    _expect("model.max_length", node.max_length, int)
    if node.max_length < 1:
        raise ConfigError(f"model.max_length={node.max_length} must be > 0")
    try:
        device = torch.device(str(node.device))
    except RuntimeError:
        raise ConfigError(f"model.device='{node.device}' is not a device; accepted: cpu, cuda, cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count or (device.index is not None and device.index >= count):
            raise ConfigError(f"model.device={node.device} but {count} CUDA devices are visible; "
                              f"accepted: cpu{''.join(f', cuda:{i}' for i in range(count))}")
    elif device.type != "cpu":
        raise ConfigError(f"model.device={node.device} is not supported; accepted: cpu, cuda, cuda:N")
    path = node.get("path")
    if node.source == "hub" and path and not Path(str(path)).is_dir():
        raise ConfigError(f"model.path={path} is not a folder; set it to a local copy of the model's files, "
                          f"or to null to load model.hub_id={node.get('hub_id')}")


def check_logger(node: DictConfig) -> None:
    from kvbench import trackers

    trackers.check(node)


def check_kernels(node: DictConfig) -> None:
    from kvbench.kernels.dispatch import BACKENDS

    if node.backend not in BACKENDS:
        raise unknown_name("kernels.backend", node.backend, BACKENDS)


def check_results_root(root) -> None:
    """The results root exists (or can be made) and takes a file."""
    path = Path(str(root))
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"results_root={root} is not a writable folder ({err.strerror or err}); "
                          f"set results_root= (or KVBENCH_RESULTS) to a folder you can write") from None


# -- value types -------------------------------------------------------------------------------------------

def _expect(key: str, value, hint) -> None:
    if not _matches(value, hint):
        raise ConfigError(f"{key}={value!r} must be {_describe(hint)}")


def _matches(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any or isinstance(hint, (str, typing.TypeVar)):
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if (origin or hint) in (list, tuple, set, frozenset):
        return isinstance(value, (list, tuple, ListConfig)) and (not args or all(_matches(v, args[0]) for v in value))
    if (origin or hint) is dict:
        return isinstance(value, (dict, DictConfig))
    return True  # other annotations (classes, callables) are not config values


def _describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if (origin or hint) in (list, tuple, set, frozenset):
        return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s" if args else "a list"
    names = {type(None): "null", bool: "true or false", int: "an integer", float: "a number", str: "a string",
             dict: "a mapping"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))
