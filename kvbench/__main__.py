"""``python -m kvbench [overrides]`` / ``python -m kvbench -m <sweep>``: the Hydra entry point.

Before Hydra runs, the run (or every point of a sweep, and the data of every task a sweep reads) is composed
and checked (``kvbench.checks``), so that bad input is one line naming the value and the accepted ones
(exit 2) and nothing is launched or written. A full disk is one line too (exit 2), and so is Ctrl-C (exit
130): the run in progress is recorded as interrupted, and the same command resumes."""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from kvbench.errors import INTERRUPTED_EXIT, ConfigError, disk_full, disk_full_line, failed_outcome, unknown_name

log = logging.getLogger("kvbench")
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
CHECKED_GROUPS = ("model", "method", "budget", "task", "logger", "kernels", "experiment")
MULTIRUN_FLAGS = ("-m", "--multirun")


def check_group_overrides(argv: list[str]) -> None:
    """Reject unknown config-group choices (``method=foo``, also inside ``-m`` sweeps ``method=a,b``) with one
    line naming the value and the accepted ones, before Hydra prints its multi-line composition error."""
    for arg in argv:
        group, sep, value = arg.partition("=")
        if not sep or group.lstrip("+~") not in CHECKED_GROUPS:
            continue
        group = group.lstrip("+~")
        accepted = sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))
        choices = value.removeprefix("choice(").removesuffix(")") if value.startswith("choice(") else value
        for choice in (c.strip().strip("'\"") for c in choices.split(",")):
            if choice and choice not in accepted:
                raise ConfigError(str(unknown_name(group, choice, accepted)))


def check_argv(argv: list[str]) -> None:
    misplaced = [a for a in argv[1:] if a in MULTIRUN_FLAGS]
    if misplaced:
        rest = " ".join(a for a in argv if a not in MULTIRUN_FLAGS)
        raise ConfigError(f"{misplaced[0]} must come first, before every override: kvbench -m {rest}")
    check_group_overrides(argv)


def composed_points(argv: list[str]) -> list[DictConfig]:
    """The composed config of the run, or of every point of a ``-m`` sweep (command-line sweeps and an
    experiment's ``hydra.sweeper.params``, expanded as Hydra's basic sweeper does)."""
    from hydra import initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = [a for a in argv if a not in MULTIRUN_FLAGS]
    parser = OverridesParser.create()

    def expand(args: list[str]) -> list[list[str]]:
        try:
            return [point for batch in BasicSweeper.split_arguments(parser.parse_overrides(args), None)
                    for point in batch]
        except Exception as err:  # noqa: BLE001 - Hydra's grammar errors: first line says it
            raise ConfigError(f"cannot parse the overrides: {str(err).splitlines()[0]}") from None

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3", job_name="kvbench"):
        if argv[:1] in ([f] for f in MULTIRUN_FLAGS):
            first = _compose(expand(overrides)[0])
            params = [f"{k}={v}" for k, v in (first.hydra.sweeper.params or {}).items()]
            return [_compose(point) for point in expand(params + overrides)]
        return [_compose(overrides)]


def _compose(overrides: list[str]) -> DictConfig:
    from hydra import compose

    try:
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    except Exception as err:  # noqa: BLE001 - Hydra's composition errors, translated to one line
        raise _composition_error(err, overrides) from None
    HydraConfig.instance().set_config(cfg)  # resolves ${hydra:...} in results_root
    return cfg


def _composition_error(err: Exception, overrides: list[str]) -> ConfigError:
    text = str(err)
    missing = re.search(r"Could not find '(.+)/([^'/]+)'", text)
    if missing:
        options = re.search(r"Available options in '[^']*':\n((?:\t.*\n?)*)", text)
        accepted = options.group(1).split() if options else []
        return unknown_name(missing.group(1), missing.group(2), accepted)
    unknown = re.search(r"Could not override '([^']+)'", text)
    if unknown:
        key = unknown.group(1)
        parent = key.rpartition(".")[0]
        # the config without any value set under the parent: group choices stay, so the node is the one meant
        keys = [o.lstrip("+~").partition("=")[0] for o in overrides]
        others = [o for o, k in zip(overrides, keys) if "." not in k and k != key]
        return ConfigError(f"unknown key {key}{accepted_keys(parent, others)}")
    return ConfigError(text.strip().splitlines()[0])


def accepted_keys(parent: str, overrides: list[str]) -> str:
    """"; accepted: <keys>": the keys one can set under ``parent`` (the root when empty); for a method or task
    (named first) also the class's fields that its YAML leaves out (those take a leading ++)."""
    from hydra import compose

    from kvbench.checks import fields_of

    try:
        cfg = compose(config_name="config", overrides=overrides)
    except Exception:  # noqa: BLE001 - the message stays useful without the list
        return ""
    node = OmegaConf.select(cfg, parent) if parent else cfg
    keys = sorted(k for k in node if k != "_target_") if isinstance(node, DictConfig) else []
    text = f"; accepted: {', '.join(keys)}"
    if parent in ("method", "task"):
        cls, fields = fields_of(parent, node)
        extra = sorted(set(fields) - set(keys))
        text = f" for {parent} {cls.name}{text}"
        if extra:
            text += f" (not in its YAML, so set with ++: {', '.join(f'++{parent}.{k}' for k in extra)})"
    return text


def print_metrics(run_dir: Path) -> None:
    import pandas as pd

    metrics = pd.read_parquet(run_dir / "metrics.parquet")
    table = Table(title=f"kvbench results ({run_dir.name})")
    for col in ("model", "method", "budget", "task", "dataset", "metric", "value", "n", "kept_fraction", "tpot_seconds"):
        table.add_column(col)
    for row in metrics.itertuples():
        table.add_row(row.model, row.method, row.budget, row.task, row.dataset, row.metric, f"{row.value:.2f}",
                      str(row.n), f"{row.kept_fraction:.3f}", f"{row.tpot_seconds * 1000:.1f} ms")
    Console(width=160).print(table)  # wide enough that no column is cut, even in CI logs


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> tuple[str, str]:
    """One run. Returns its outcome for the sweep launchers' summary: (done | skipped | failed, detail).
    Bad input and a full disk are one line: exit 2 for a single run, a failed outcome in a sweep (whose
    launcher stops at a full disk)."""
    from kvbench.runner import run

    hydra = HydraConfig.get()
    try:
        run_dir = run(cfg, hydra_dir=Path(hydra.runtime.output_dir), overrides=list(hydra.overrides.task))
    except Exception as err:  # noqa: BLE001 - sorted below: bad input, a full disk, or a bug (re-raised)
        full = disk_full(err)
        if not isinstance(err, ConfigError) and full is None:
            raise
        line = str(err) if full is None else disk_full_line(full, cfg.results_root)
        log.error("kvbench: error: %s", line)
        if hydra.mode == RunMode.MULTIRUN:  # the sweep's summary says it; a SLURM job still returns a result
            return failed_outcome(err, cfg.results_root)
        print(f"kvbench: error: {line}", file=sys.stderr)
        sys.exit(2)
    if run_dir is None:
        return "skipped", "finished before"
    print_metrics(run_dir)
    return "done", str(run_dir)


def quote_numeric_choices(argv: list[str]) -> list[str]:
    """``budget=0.2`` must select conf/budget/0.2.yaml, but Hydra's grammar reads 0.2 as a float and refuses
    it as a group choice; quoting each choice (``budget='0.2'``, ``budget='0.1','0.5'``) makes it a name."""
    out = []
    for arg in argv:
        group, sep, value = arg.partition("=")
        if sep and group.lstrip("+~") == "budget" and not value.startswith(("choice(", "'", '"')):
            value = ",".join(f"'{c.strip()}'" for c in value.split(","))
        out.append(f"{group}{sep}{value}" if sep else arg)
    return out


def entry() -> None:
    argv = sys.argv[1:]
    if argv[:1] in (["-h"], ["--help"]):
        from kvbench.cli import usage

        print(usage())
        sys.exit(0)
    argv = sys.argv[1:] = quote_numeric_choices(argv)
    hydra_flags = [a for a in argv if a.startswith("-") and a not in MULTIRUN_FLAGS]
    root = None
    try:
        check_argv(argv)
        if not hydra_flags:  # --cfg, --info, --hydra-help ...: Hydra's own commands, left to Hydra
            from kvbench.checks import check_data, validate

            points = composed_points(argv)
            for cfg in points:
                validate(cfg)
            root = points[0].results_root
            if argv[:1] in ([f] for f in MULTIRUN_FLAGS):
                check_data(points)
        run_app()
    except ConfigError as err:
        print(f"kvbench: error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("kvbench: interrupted (Ctrl-C): the run in progress was not published (kvbench status shows it "
              "as interrupted); run the same command again to resume", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT)
    except Exception as err:  # noqa: BLE001 - a full disk is one line; anything else is a bug: re-raised
        full = disk_full(err)
        if full is None:
            raise
        print(f"kvbench: error: {disk_full_line(full, root)}", file=sys.stderr)
        sys.exit(2)


def run_app() -> None:
    """The Hydra app, with Hydra's own error report off (HYDRA_FULL_ERROR) so that its exceptions reach
    ``entry``: a full disk strikes Hydra's own writes (the job's .hydra/ files) as well as kvbench's."""
    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous


if __name__ == "__main__":
    entry()
