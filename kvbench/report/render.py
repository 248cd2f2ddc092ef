"""A ``tables.Table`` as Markdown, LaTeX (booktabs) and CSV. Markdown/LaTeX use the papers' display names;
the CSV keeps kvbench names and unrounded values (machine-readable, with CI and p-value columns)."""

from __future__ import annotations

import math

import pandas as pd

from kvbench.report.paper import (DATASET_DISPLAY, METHOD_DISPLAY, MODEL_DISPLAY, budget_display, display,
                                  kept_display)
from kvbench.report.stats import PAIRED_TEST
from kvbench.report.tables import OURS, Table

DELTA = "Δ vs Full"
OTHER_SAMPLES = "‡"  # the cell's samples are not the full cache's: not compared
KEPT_COLUMN = "Kept"  # the realized kept fraction, beside the budget label


# metric name ending -> (factor, unit) for display; the CSV keeps SI values
UNITS = {"_bytes": (2.0**-30, "GiB"), "_seconds": (1000.0, "ms")}


def unit_of(column: str) -> tuple[float, str]:
    metric = column.partition("/")[2]
    if metric.startswith("ratio."):  # ratios of times or bytes are plain numbers
        return 1.0, ""
    return next(((f, u) for end, (f, u) in UNITS.items() if metric.endswith(end)), (1.0, ""))


def column_display(column: str) -> str:
    """A column's header: its dataset's display name, the metric and its unit."""
    dataset, _, metric = column.partition("/")
    name = display(dataset, DATASET_DISPLAY)
    unit = unit_of(column)[1]
    return f"{name} {metric}" + (f" ({unit})" if unit else "") if metric else name


def method_display(method: str, source: str) -> str:
    method, at, budget = method.partition("@")  # rows aligned by kept fraction carry their budget label
    base, bracket, rest = method.partition("[")
    name = display(base, METHOD_DISPLAY) + (f" [{rest}" if bracket else "")
    name += f" @ {budget_display(budget)}" if at else ""
    if source != OURS:
        paper, _, table_id = source.removeprefix("paper:").partition("/")
        name += f" (paper: {paper} {table_id.replace('table', 'T')})"
    return name


def _number(value, digits: int) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def cells(table: Table, cfg, bold_open: str, bold_close: str) -> list[list[str]]:
    """Rows of display strings: labels, one cell per column, then delta (when shown as a column)."""
    digits, out = int(cfg.digits), []
    for row in table.values.index:
        model, budget, method, source = row
        line = [display(model, MODEL_DISPLAY), budget_display(budget), kept_display(table.kept[row]),
                method_display(method, source), samples_display(table, row)]
        for column in table.values.columns:
            text = _number(table.values.at[row, column] * unit_of(column)[0], digits)
            if text != "–" and cfg.bold_best and table.bold.at[row, column]:
                text = f"{bold_open}{text}{bold_close}"
            if text != "–" and column in table.data_columns:
                text += _annotations(table, row, column, cfg)
            line.append(text)
        if show_delta(table, cfg):
            delta = table.delta[row]
            line.append("" if math.isnan(delta) else f"{delta:+.{digits}f}")
        out.append(line)
    return out


def samples_display(table: Table, row) -> str:
    """n of a row: samples per data column ("3"; "2–6" when the columns differ); empty for paper rows."""
    if row not in table.n.index:
        return ""
    counts = table.n.loc[row].dropna()
    if counts.empty:
        return ""
    low, high = int(counts.min()), int(counts.max())
    return str(low) if low == high else f"{low}–{high}"


def _annotations(table: Table, row, column: str, cfg) -> str:
    text = OTHER_SAMPLES if table.other_samples.at[row, column] else ""
    if cfg.ci and table.ci_lo is not None and not math.isnan(table.ci_lo.at[row, column]):
        text += f" [{table.ci_lo.at[row, column]:.{int(cfg.digits)}f}, {table.ci_hi.at[row, column]:.{int(cfg.digits)}f}]"
    if cfg.pvalues and table.p_vs_full is not None and table.p_vs_full.at[row, column] < float(cfg.stats.alpha):
        text += "†"
    return text


def header(table: Table, cfg) -> list[str]:
    names = ["Model", "Budget", KEPT_COLUMN, "Method", "n",
             *(column_display(c) for c in table.values.columns)]
    return names + ([DELTA] if show_delta(table, cfg) else [])


def show_delta(table: Table, cfg) -> bool:
    return cfg.delta == "column" and bool(table.delta.notna().any())


def markdown(table: Table, cfg) -> str:
    head = header(table, cfg)
    align = ["---", "---", "---:", "---", "---:"] + ["---:"] * (len(head) - 5)  # Model, Budget, Kept, Method, n
    lines = [f"Query mode: {table.modes}.", "", "| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in cells(table, cfg, "**", "**")]
    return "\n".join(lines) + "\n\n" + " ".join(notes(table, cfg)) + "\n"


def notes(table: Table, cfg) -> list[str]:
    out = ["n: samples per dataset.", "Best compressed method per model × budget block in bold (higher is better;"
           " lower for perplexity, time and memory).", f"{KEPT_COLUMN}: realized kept fraction (kept slots / prompt"
           " length, mean over samples, layers and heads)."]
    if table.other_samples.to_numpy().any():
        out.append(f"{OTHER_SAMPLES}: scored on other samples than the full cache (another limit or data): "
                   "not ranked, no Δ.")
    if cfg.ci:
        out.append("[lo, hi]: bootstrap 95% confidence interval over samples.")
    if cfg.pvalues:
        out.append(f"†: p < {cfg.stats.alpha} vs the full cache in a {PAIRED_TEST} on the samples both scored.")
    return out


def latex_escape(text: str) -> str:
    for char, escaped in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_"), ("#", r"\#"),
                          ("Δ", r"$\Delta$"), ("†", r"$^\dagger$"), ("–", "--")):
        text = text.replace(char, escaped)
    return text


def latex(table: Table, cfg) -> str:
    head = header(table, cfg)
    rows = cells(table, cfg, "\x00", "\x01")
    lines = [f"% query mode: {table.modes}", r"\begin{tabular}{llrl" + "r" * (len(head) - 4) + "}", r"\toprule",
             " & ".join(latex_escape(h) for h in head) + r" \\", r"\midrule"]
    previous = None
    for index, row in zip(table.values.index, rows):
        if previous is not None and index[0] != previous[0]:
            lines.append(r"\midrule")
        elif previous is not None and index[1] != previous[1]:
            lines.append(rf"\cmidrule(lr){{3-{len(head)}}}")
        previous = index
        text = [latex_escape(c).replace("\x00", r"\textbf{").replace("\x01", "}") for c in row]
        lines.append(" & ".join(text) + r" \\")
    return "\n".join(lines + [r"\bottomrule", r"\end{tabular}"]) + "\n"


def csv_frame(table: Table, cfg) -> pd.DataFrame:
    frame = table.values.copy()
    frame.insert(0, "kept_fraction", table.kept)
    frame[DELTA] = table.delta
    if table.ci_lo is not None:
        for column in table.data_columns:
            frame[f"{column}:ci_lo"] = table.ci_lo[column]
            frame[f"{column}:ci_hi"] = table.ci_hi[column]
            frame[f"{column}:p_vs_full"] = table.p_vs_full[column]
    for column in table.data_columns:
        frame[f"{column}:n"] = table.n[column]
        frame[f"{column}:other_samples"] = table.other_samples[column]
    for column in table.values.columns:
        frame[f"{column}:best"] = table.bold[column]
    frame["mode"] = table.modes
    return frame.reset_index()


def pvalue_markdown(table: Table, digits: int) -> str:
    frame = table.pvalues
    head = ("| Model | Budget | Dataset | Metric | Method | vs | n | Δ | p |\n"
            "|---|---|---|---|---|---|---:|---:|---:|\n")
    body = "".join(
        f"| {display(r.model, MODEL_DISPLAY)} | {budget_display(r.budget)} | {column_display(r.dataset)} | {r.metric} "
        f"| {method_display(r.method_a, OURS)} | {method_display(r.method_b, OURS)} ({budget_display(r.budget_b)}) "
        f"| {r.n} | {r.delta:+.{digits}f} | {r.p_value:.4f} |\n" for r in frame.itertuples())
    return head + body + f"\np: two-sided {PAIRED_TEST} on the n samples both rows scored.\n"
