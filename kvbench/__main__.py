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

from kvbench.errors import ConfigError

log = logging.getLogger("kvbench")
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def print_metrics(run_dir: Path) -> None:
    import pandas as pd

    metrics = pd.read_parquet(run_dir / "metrics.parquet")
    table = Table(title=f"kvbench results ({run_dir.name})")
    for col in ("model", "method", "budget", "task", "dataset", "metric", "value", "n", "kept_fraction", "tpot_seconds"):
        table.add_column(col)
    for row in metrics.itertuples():
        table.add_row(row.model, row.method, row.budget, row.task, row.dataset, row.metric, f"{row.value:.2f}",
                      str(row.n), f"{row.kept_fraction:.3f}", f"{row.tpot_seconds * 1000:.1f} ms")
    Console().print(table)


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


if __name__ == "__main__":
    main()
