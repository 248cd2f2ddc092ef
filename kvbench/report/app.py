"""``python -m kvbench.report`` / ``kvbench report``: read ``<root>/metrics.parquet`` and
``predictions.parquet`` and write ``<out>/tables/<task>.{md,tex,csv}`` (+ ``<task>_pvalues.*``),
``<out>/plots/*.{png,pdf}`` and ``<out>/report.md`` (every table and plot). Settings: conf/report/default.yaml,
overridden by ``key=value`` arguments (``table.ci=true``) and the flags below."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omegaconf import OmegaConf

from kvbench.errors import ConfigError
from kvbench.report import data, efficiency, paper, plots, render, tables

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "conf" / "report" / "default.yaml"


def parse(argv: list[str]):
    parser = argparse.ArgumentParser(prog="kvbench report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", help="results root (holds metrics.parquet)")
    parser.add_argument("--out", help="output folder (default <root>/report)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="report config YAML")
    for name in data.FILTER_COLUMNS:
        parser.add_argument(f"--{name}", action="append", help=f"keep only this {name} (repeat or comma-separate)")
    parser.add_argument("--ci", action="store_true", help="bootstrap 95%% CIs in the tables")
    parser.add_argument("--pvalues", action="store_true", help="paired bootstrap p-values")
    parser.add_argument("--no-paper", action="store_true", help="leave out the papers' numbers")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("overrides", nargs="*", help="config overrides key=value (e.g. table.digits=1)")
    return parser.parse_args(argv)


def config(args) -> OmegaConf:
    if not args.config.exists():
        raise ConfigError(f"report config '{args.config}' does not exist")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise ConfigError(f"report arguments {bad} are not key=value overrides")
    cfg = OmegaConf.merge(OmegaConf.load(args.config), OmegaConf.from_dotlist(args.overrides))
    cfg.root = args.root or cfg.root
    cfg.out = args.out or cfg.out or str(Path(cfg.root) / "report")
    for name in data.FILTER_COLUMNS:
        if getattr(args, name):
            cfg.filters[name] = [v for arg in getattr(args, name) for v in arg.split(",") if v]
    cfg.table.ci = cfg.table.ci or args.ci
    cfg.table.pvalues = cfg.table.pvalues or args.pvalues
    cfg.table.paper = cfg.table.paper and not args.no_paper
    cfg.plots.enabled = cfg.plots.enabled and not args.no_plots
    if cfg.table.delta not in ("column", "none"):
        raise ConfigError(f"unknown table.delta '{cfg.table.delta}'; accepted: column, none")
    if cfg.table.align not in ("budget", "kept"):
        raise ConfigError(f"unknown table.align '{cfg.table.align}'; accepted: budget, kept")
    return cfg


def write_table(table: tables.Table, cfg, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    writers = {"md": lambda: render.markdown(table, cfg.table), "tex": lambda: render.latex(table, cfg.table)}
    paths = []
    for fmt in cfg.table.formats:
        path = out / f"{table.task}.{fmt}"
        if fmt == "csv":
            render.csv_frame(table, cfg.table).to_csv(path, index=False)
        elif fmt in writers:
            path.write_text(writers[fmt]())
        else:
            raise ConfigError(f"unknown table format '{fmt}'; accepted: md, tex, csv")
        paths.append(path)
    if cfg.table.pvalues and table.pvalues is not None:
        table.pvalues.to_csv(out / f"{table.task}_pvalues.csv", index=False)
        (out / f"{table.task}_pvalues.md").write_text(render.pvalue_markdown(table, int(cfg.table.digits)))
        paths += [out / f"{table.task}_pvalues.csv", out / f"{table.task}_pvalues.md"]
    return paths


def make_plots(cfg, built: list, metrics, predictions, out: Path) -> list[Path]:
    formats = list(cfg.plots.formats)
    order = list(cfg.table.method_order)
    paths = plots.needle_heatmaps(predictions, dict(cfg.plots.needle_metric), order, out, formats)
    for table in (t for t in built if not t.task.startswith(efficiency.TASK)):  # efficiency has its own figures
        budgets = metrics[metrics["task"] == table.task].drop_duplicates(["model", "budget"])
        paths += plots.score_vs_budget(table, budgets, out, formats)
    paths += plots.perplexity_curves(metrics, cfg.plots.pg19_curve, out, formats)
    paths += plots.kept_ratio(predictions, order, out, formats)
    paths += efficiency.figures(metrics, predictions, order, out, formats)
    return paths


def report(cfg) -> list[Path]:
    results = data.load(Path(cfg.root))
    warn(results.notes)  # before anything else can fail: they say what the tables leave out
    metrics = data.apply_filters(results.metrics, OmegaConf.to_container(cfg.filters))
    if metrics.empty:
        raise ConfigError(f"no results under '{cfg.root}' pass the filters {OmegaConf.to_container(cfg.filters)}")
    metrics = data.label_rows(efficiency.table_per_measure(metrics))
    if cfg.table.align == "kept":
        metrics = data.align_by_kept(metrics, float(cfg.table.kept_step))
    predictions = data.labelled_predictions(results, metrics)
    reference = paper.reference() if cfg.table.paper else None
    out = Path(cfg.out)
    built = [t for t in (tables.build(metrics, predictions, reference, task, cfg.table)
                         for task in sorted(metrics["task"].unique())) if t is not None]
    written = [p for t in built for p in write_table(t, cfg, out / "tables")]
    if cfg.plots.enabled:
        written += make_plots(cfg, built, metrics, predictions, out / "plots")
    found = caveats(built, metrics)
    warn(found)
    warnings = results.notes + found
    summary = [f"# kvbench report\n\nResults root: `{cfg.root}`\n"]
    if warnings:
        summary.append("## Caveats\n\n" + "".join(f"- {line}\n" for line in warnings))
    summary += [f"## {t.task} (query mode: {t.modes})\n\n{render.markdown(t, cfg.table)}" for t in built]
    summary += [f"![{p.stem}](plots/{p.name})\n" for p in written if p.suffix == ".png"]
    (out / "report.md").write_text("\n".join(summary))
    return written + [out / "report.md"]


def warn(lines: list[str]) -> None:
    for line in lines:
        print(f"kvbench report: warning: {line}", file=sys.stderr)


def caveats(built: list[tables.Table], metrics) -> list[str]:
    """What a reader must know before comparing numbers: cells scored on other samples than the full cache
    (marked, not compared), and timings taken while other runs shared the device (``concurrent_runs``)."""
    lines = []
    for table in built:
        for row in table.other_samples.index[table.other_samples.any(axis=1)]:
            model, budget, method, _ = row
            columns = [c for c in table.data_columns if table.other_samples.at[row, c]]
            n = ", ".join(str(int(table.n.at[row, c])) for c in columns)
            lines.append(f"{table.task}: {model} / {method} / {budget} was scored on other samples than the full "
                         f"cache in {', '.join(columns)} (n = {n}): marked {render.OTHER_SAMPLES}, not compared")
    if "concurrent_runs" in metrics:
        shared = metrics[metrics["concurrent_runs"].fillna(0) > 0].drop_duplicates("run_id")
        for row in shared.itertuples():
            lines.append(f"{row.task}: the timings of {row.model} / {row.method} / {row.budget} were taken while "
                         f"{int(row.concurrent_runs)} other runs shared its device (run {row.run_id})")
    return lines


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = config(parse(sys.argv[1:] if argv is None else argv))
        written = report(cfg)
    except ConfigError as err:
        print(f"kvbench report: error: {err}", file=sys.stderr)
        return 2
    print(f"kvbench report: wrote {len(written)} files under {cfg.out}")
    return 0
