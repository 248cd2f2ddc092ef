"""Comparison tables in the papers' layout: rows = model x budget x method (full cache first in each model
block; paper rows beside ours), columns = datasets (+ LongBench category averages and the overall average),
best compressed method per model x budget block marked, delta vs full cache, optional bootstrap CIs and
paired p-values, the number of samples behind each cell, and the cells scored on other samples than the
full cache marked (no delta, not ranked); every row carries its realized kept fraction (shown beside the
budget). Rendering is in ``render.py``."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kvbench.report import stats
from kvbench.report.data import other_samples
from kvbench.report.paper import FULL
from kvbench.tasks.longbench import CATEGORIES, CATEGORY_OF, language_of
from kvbench.tasks.zeroscrolls import PRIMARY_METRIC

OURS = "ours"
INDEX = ["model", "budget", "method", "source"]
# Suites whose papers print category and overall averages (recomputed here from the dataset columns shown).
SUITE_AVERAGE = {"longbench": "avg:overall", "zeroscrolls": "avg:zeroscrolls"}


def lower_is_better(metric: str) -> bool:
    return metric.startswith("ppl") or metric.endswith(("seconds", "bytes"))


@dataclass
class Table:
    task: str
    values: pd.DataFrame  # index INDEX, columns = data columns + average columns
    data_columns: list[str]
    bold: pd.DataFrame = None
    delta: pd.Series = None
    ci_lo: pd.DataFrame | None = None
    ci_hi: pd.DataFrame | None = None
    p_vs_full: pd.DataFrame | None = None
    pvalues: pd.DataFrame | None = None  # long: model, budget, dataset, metric, method_a, method_b, delta, p
    column_metric: dict = field(default_factory=dict)  # column -> (dataset, metric) for data columns
    modes: str = ""  # the query modes of the table's results (official, query_agnostic, no_query)
    n: pd.DataFrame | None = None  # samples behind each of our cells (index INDEX, data columns)
    other_samples: pd.DataFrame | None = None  # True: the cell's samples are not the full cache's
    kept: pd.Series = None  # realized kept fraction per row (mean over the row's runs; NaN for paper rows)


def select_metrics(metrics: pd.DataFrame, task: str, wanted: list[str] | None) -> pd.DataFrame:
    """The task's metric rows shown in its table: length bucket "all", no precomputed averages, and the
    configured metrics ("primary" = ZeroSCROLLS' per-task primary metric; none = every metric)."""
    rows = metrics[(metrics["length_bucket"] == "all") & ~metrics["dataset"].astype(str).str.startswith("avg:")]
    if not wanted:
        return rows
    keep = rows["metric"].isin(wanted)
    if "primary" in wanted:
        keep |= rows["metric"] == rows["dataset"].map(PRIMARY_METRIC)
    return rows[keep]


def column_order(columns: list[str], task: str) -> list[str]:
    if task == "longbench":
        rank = {d: i for i, d in enumerate(d for ds in CATEGORIES.values() for d in ds)}
        return sorted(columns, key=lambda c: (rank.get(c.split("/")[0], len(rank)), c))
    return sorted(columns)


def row_order(index: list[tuple], method_order: list[str], budget_kind: dict) -> list[tuple]:
    def key(row):
        model, budget, method, source = row
        base = method.split("[")[0].split("@")[0]
        budget_key = (-1, 0.0) if budget == FULL else (budget_kind.get(budget, ("fraction", 0))[0] != "fraction",
                                                       budget_kind.get(budget, ("", 0.0))[1])
        m = method_order.index(base) if base in method_order else len(method_order)
        return (model, budget_key, m, method, source != OURS, source)
    return sorted(index, key=key)


def build(metrics: pd.DataFrame, predictions: pd.DataFrame, reference: pd.DataFrame, task: str, cfg) -> Table | None:
    rows = select_metrics(metrics[metrics["task"] == task], task, list(cfg.metrics.get(task) or []))
    if rows.empty:
        return None
    single = rows["metric"].nunique() == 1 or "primary" in list(cfg.metrics.get(task) or [])
    rows = rows.assign(column=rows["dataset"] if single else rows["dataset"] + "/" + rows["metric"])
    column_metric = dict(zip(rows["column"], zip(rows["dataset"], rows["metric"])))
    rows = rows.assign(other_samples=other_samples(rows))
    wide = {name: _ours(rows, name) for name in ("value", "n", "other_samples")}
    data_columns = column_order(list(wide["value"].columns), task)
    values = wide["value"][data_columns]
    if cfg.paper:
        values = pd.concat([values, paper_rows(rows, reference, task, data_columns, single)])
    budget_kind = dict(zip(rows["budget"], zip(rows["budget_kind"], rows["budget_value"])))
    order = row_order(list(values.index), list(cfg.method_order), budget_kind)
    values = values.reindex(pd.MultiIndex.from_tuples(order, names=INDEX))
    values = add_averages(values, data_columns, task)
    modes = ", ".join(sorted(rows["mode"].dropna().astype(str).unique())) if "mode" in rows else ""
    table = Table(task, values, data_columns, column_metric=column_metric, modes=modes or "unrecorded",
                  n=wide["n"].reindex(index=values.index, columns=data_columns),
                  other_samples=wide["other_samples"].reindex(index=values.index, columns=data_columns)
                  .fillna(False).astype(bool),
                  kept=kept_per_row(rows, values.index))
    table.bold = best_per_block(values.mask(_spread(table.other_samples, values.columns)),
                                {c: lower_is_better(m) for c, (_, m) in column_metric.items()})
    table.delta = delta_vs_full(values, data_columns, task).mask(table.other_samples.any(axis=1))
    if cfg.ci or cfg.pvalues:
        add_statistics(table, predictions[predictions["task"] == task], cfg)
    return table


def _ours(rows: pd.DataFrame, name: str) -> pd.DataFrame:
    """One column of our rows as a table: index INDEX (source "ours"), one column per data column."""
    wide = rows.pivot_table(index=["model", "budget", "row_method"], columns="column", values=name, aggfunc="first")
    wide.index = pd.MultiIndex.from_tuples([(*i, OURS) for i in wide.index], names=INDEX)
    return wide


def _spread(cells: pd.DataFrame, columns) -> pd.DataFrame:
    """Per-data-column flags extended to the average columns: an average is flagged if a row flags any cell."""
    out = cells.reindex(columns=columns, fill_value=False)
    for column in columns.difference(cells.columns):
        out[column] = cells.any(axis=1)
    return out.astype(bool)


def kept_per_row(rows: pd.DataFrame, index: pd.MultiIndex) -> pd.Series:
    """Realized kept fraction of each of our rows: the mean over its runs of the run's ``kept_fraction``."""
    if "kept_fraction" not in rows:
        return pd.Series(np.nan, index=index)
    runs = rows.drop_duplicates("run_id")
    kept = runs.groupby(["model", "budget", "row_method"])["kept_fraction"].mean()
    return pd.Series([kept.get(r[:3], np.nan) if r[3] == OURS else np.nan for r in index], index=index)


def paper_rows(rows: pd.DataFrame, reference: pd.DataFrame, task: str, columns: list[str], single: bool) -> pd.DataFrame:
    """For each of our rows, the matching paper numbers (same model, budget, method and implied
    hyperparameters): one row per paper, from that paper's table with the most matching columns."""
    if reference.empty:
        return pd.DataFrame(columns=columns)
    ref = reference[reference["task"] == task].copy()
    ref["column"] = ref["dataset"] if single else ref["dataset"] + "/" + ref["metric"]
    ref = ref[ref["column"].isin(columns)]
    out = {}
    for (model, budget, row_method), ours in rows.groupby(["model", "budget", "row_method"]):
        first = ours.iloc[0]
        cand = ref[(ref["model"] == model) & (ref["budget"] == budget) & (ref["method"] == first["method"])]
        match = [all(str(first.get(f"method.{k}")) == v for k, v in p) for p in cand["method_params"]]
        cand = cand.loc[np.array(match, dtype=bool)]
        for paper, group in cand.groupby("paper"):
            best = group.groupby("table_id")["column"].nunique().sort_values(ascending=False, kind="stable").index[0]
            chosen = group[group["table_id"] == best]
            out[(model, budget, row_method, f"paper:{paper}/{best}")] = dict(zip(chosen["column"], chosen["value"]))
    frame = pd.DataFrame.from_dict(out, orient="index", columns=columns)
    frame.index = pd.MultiIndex.from_tuples(frame.index, names=INDEX) if out else frame.index
    return frame


def add_averages(values: pd.DataFrame, data_columns: list[str], task: str) -> pd.DataFrame:
    """LongBench category averages and the suite's overall average, each the mean of the row's dataset
    columns (NaN where the row misses one of them), as the papers compute them; for LongBench also the
    official leaderboard's Avg per language (the mean of that language's category means)."""
    if task not in SUITE_AVERAGE or len(data_columns) < 2:
        return values
    values = values.copy()
    if task == "longbench":
        for category in CATEGORIES:
            members = [c for c in data_columns if CATEGORY_OF.get(c) == category]
            if members and len(members) < len(data_columns):
                values[f"avg:{category}"] = values[members].mean(axis=1, skipna=False)
    values[SUITE_AVERAGE[task]] = values[data_columns].mean(axis=1, skipna=False)
    if task == "longbench":
        for language in ("en", "zh"):
            categories = {CATEGORY_OF[c] for c in data_columns if c in CATEGORY_OF and language_of(c) == language}
            means = [values[[c for c in data_columns if CATEGORY_OF.get(c) == category and language_of(c) == language]]
                     .mean(axis=1, skipna=False) for category in sorted(categories)]
            if means:
                values[f"avg:leaderboard_{language}"] = pd.concat(means, axis=1).mean(axis=1, skipna=False)
    return values


def best_per_block(values: pd.DataFrame, lower: dict[str, bool]) -> pd.DataFrame:
    """True where a compressed method of ours is best in its model x budget block (ties all marked); lower
    is better for the columns ``lower`` says (averages follow their datasets' metric)."""
    lower_all = any(lower.values())
    bold = pd.DataFrame(False, index=values.index, columns=values.columns)
    ours = values[(values.index.get_level_values("source") == OURS) & (values.index.get_level_values("budget") != FULL)]
    for _, block in ours.groupby(level=["model", "budget"], sort=False):
        best = pd.Series({c: block[c].min() if lower.get(c, lower_all) else block[c].max() for c in block.columns})
        bold.loc[block.index] = block.eq(best) & block.notna()
    return bold


def delta_vs_full(values: pd.DataFrame, data_columns: list[str], task: str) -> pd.Series:
    """Row minus the full-cache row of the same model and source: on the overall average when the table has
    one, else the mean over dataset columns of the per-column differences; NaN for tables mixing metrics."""
    summary = SUITE_AVERAGE.get(task) if SUITE_AVERAGE.get(task) in values.columns else None
    delta = pd.Series(np.nan, index=values.index)
    if not summary and any("/" in c for c in data_columns):
        return delta
    for row in values.index:
        model, budget, method, source = row
        full = [r for r in values.index if r[0] == model and r[1] == FULL and r[3].split("/")[0] == source.split("/")[0]]
        if budget == FULL or not full:
            continue
        if summary:
            delta[row] = values.at[row, summary] - values.at[full[0], summary]
        else:
            delta[row] = (values.loc[row, data_columns] - values.loc[full[0], data_columns]).mean()
    return delta


def add_statistics(table: Table, predictions: pd.DataFrame, cfg) -> None:
    """Bootstrap CI per (our row, data column) and paired permutation p-values vs full and between methods of a
    block, each on the samples both rows scored (``n`` in the p-value table)."""
    shape = dict(index=table.values.index, columns=table.data_columns)
    table.ci_lo, table.ci_hi = pd.DataFrame(np.nan, **shape), pd.DataFrame(np.nan, **shape)
    table.p_vs_full = pd.DataFrame(np.nan, **shape)
    long = []
    resamples, seed = int(cfg.stats.resamples), int(cfg.stats.seed)
    for column in table.data_columns:
        dataset, metric = table.column_metric[column]
        wide = stats.per_sample(predictions[predictions["dataset"] == dataset], metric)
        if wide.empty:
            continue
        for model, frame in wide.groupby(level="model"):
            long += _column_statistics(table, column, dataset, metric, model, frame, resamples, seed)
    table.pvalues = pd.DataFrame(long, columns=["model", "budget", "dataset", "metric", "method_a", "budget_b",
                                                "method_b", "delta", "p_value", "n"]).assign(test=stats.PAIRED_TEST)


def _column_statistics(table, column, dataset, metric, model, frame, resamples, seed) -> list[tuple]:
    """CI and p-values of one data column for one model; ``frame`` columns are (budget, row_method)."""
    out = []
    fulls = [c for c in frame.columns if c[0] == FULL]
    for budget, method in frame.columns:
        row = (model, budget, method, OURS)
        if row not in table.ci_lo.index:
            continue
        table.ci_lo.at[row, column], table.ci_hi.at[row, column] = stats.bootstrap_ci(
            frame[(budget, method)].to_numpy(), resamples, seed)
        others = fulls + [c for c in frame.columns if c[0] == budget and c[1] > method]
        for other in (o for o in others if o != (budget, method)):
            pair = frame[[(budget, method), other]].dropna()
            if pair.empty:
                continue
            a, b = pair.iloc[:, 0].to_numpy(), pair.iloc[:, 1].to_numpy()
            p = stats.paired_permutation_pvalue(a, b, resamples, seed)
            out.append((model, budget, dataset, metric, method, other[0], other[1], 100 * float((a - b).mean()), p,
                        len(pair)))
            if other[0] == FULL:
                table.p_vs_full.at[row, column] = p
    return out
