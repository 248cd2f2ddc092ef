"""``python -m kvbench [overrides]`` / ``python -m kvbench -m <sweep>``: the Hydra entry point."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from kvbench.errors import ConfigError, unknown_name

log = logging.getLogger("kvbench")
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
CHECKED_GROUPS = ("model", "method", "budget", "task", "logger", "kernels")


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
def main(cfg: DictConfig) -> None:
    from kvbench.runner import run

    try:
        run_dir = run(cfg, hydra_dir=Path(HydraConfig.get().runtime.output_dir))
    except ConfigError as err:
        log.error("kvbench: error: %s", err)
        print(f"kvbench: error: {err}", file=sys.stderr)
        sys.exit(2)
    if run_dir is not None:
        print_metrics(run_dir)


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
    sys.argv[1:] = quote_numeric_choices(sys.argv[1:])
    try:
        check_group_overrides(sys.argv[1:])
    except ConfigError as err:
        print(f"kvbench: error: {err}", file=sys.stderr)
        sys.exit(2)
    main()


if __name__ == "__main__":
    entry()
