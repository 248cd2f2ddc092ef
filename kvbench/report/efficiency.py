"""Efficiency in the report: the throughput mode's own table, and the figures a paper shows.

- ``efficiency`` (latency mode) and ``efficiency_throughput`` (throughput mode) are separate tables: their
  cells (``len<n>_bs<b>`` and ``len<n>_throughput``) and metrics differ.
- Per table, model, budget and batch (a latency batch size, or the throughput mode's largest batch): TPOT,
  decode tokens/s, peak memory (and the largest batch) against the context length, each method beside the
  full cache, TPOT with each one's bytes-read bound drawn as a dotted line; with a single context length the
  same panels as bars (the bound a black tick on each TPOT bar, the achieved fraction written above it).
- Decode tokens/s against the batch (every try of the throughput search that fitted, and latency batch
  sizes), out-of-memory tries marked on the batch axis.
- Tasks other than efficiency with per-sample timings and a context length: TPOT and peak memory against it.

The full cache is the runs' same-run reference (their ``full.*`` metrics, median over runs), so it is drawn
even when no run used ``method=full``.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from kvbench.report.paper import FULL, MODEL_DISPLAY, budget_display, display  # noqa: E402
from kvbench.report.plots import _kept, _method_label, _methods_by_budget, _name, _ordered, save  # noqa: E402

TASK = "efficiency"
THROUGHPUT_TABLE = "efficiency_throughput"
CELL = r"len(\d+)_(?:bs(\d+)|throughput)$"  # the efficiency task's datasets
LARGEST = "largest batch"
# measure -> (axis label, factor from SI); panels appear for the measures a figure has values of
PANELS = {
    "tpot_seconds": ("TPOT (ms)", 1000.0),
    "decode_tokens_per_second": ("decode tokens/s", 1.0),
    "peak_memory_bytes": ("peak memory (GiB)", 2.0**-30),
    "max_batch": ("largest batch", 1.0),
}
MEASURES = (*PANELS, "tpot_bound_seconds")
ID = ["task", "model", "budget", "row_method", "batch", "context_length"]


def table_per_measure(metrics: pd.DataFrame) -> pd.DataFrame:
    """Efficiency rows of throughput-mode runs become the ``efficiency_throughput`` table's rows; runs from
    before the modes existed measured latency (so their rows and newer ones stay one table row)."""
    if "task.measure" not in metrics:
        return metrics
    efficiency = metrics["task"] == TASK
    mode = metrics["task.measure"].where(~efficiency | metrics["task.measure"].notna(), "latency")
    return metrics.assign(**{"task.measure": mode, "task": metrics["task"].where(mode != "throughput", THROUGHPUT_TABLE)})


def figures(metrics: pd.DataFrame, predictions: pd.DataFrame, order: list[str], out, formats) -> list:
    points = cell_points(metrics)
    points = pd.concat([points, sample_points(predictions[~predictions["task"].str.startswith(TASK)])])
    paths = []
    for (task, batch), task_points in points.groupby(["task", "batch"], sort=True):
        for model, budget, frame in _methods_by_budget(task_points):
            single = frame["context_length"].nunique() == 1
            fig = (_bars if single else _lines)(frame, _ordered(frame["row_method"], order))
            title = f"{task}: {display(model, MODEL_DISPLAY)}, budget {budget_display(budget)}"
            title += f", {batch}" if batch else ""
            title += f", {int(frame['context_length'].iloc[0])} tokens" if single else ""
            fig.suptitle(title, fontsize=10)
            paths += save(fig, out, _name("efficiency", task, model, budget, batch.replace(" ", "")), formats)
    return paths + batch_figures(predictions, order, out, formats)


def cell_points(metrics: pd.DataFrame) -> pd.DataFrame:
    """Columns ``ID`` + ``MEASURES`` from the efficiency tables' metric rows: the configured method's values
    per run (runs of ``method=full`` left out), and the full cache (budget and row_method "full") as the
    median over runs of their same-run reference."""
    eff = metrics[metrics["task"].str.startswith(TASK) & metrics["metric"].str.match(r"(method|full)\.")]
    cell = eff["dataset"].str.extract(CELL)
    system, measure = eff["metric"].str.split(".", n=1).str[0], eff["metric"].str.split(".", n=1).str[1]
    eff = eff.assign(context_length=cell[0].astype(float), system=system, measure=measure,
                     batch=np.where(cell[1].isna(), LARGEST, "batch " + cell[1].fillna("")))
    eff = eff[eff["measure"].isin(MEASURES) & eff["context_length"].notna()]
    if eff.empty:
        return pd.DataFrame(columns=ID)
    method = eff[(eff["system"] == "method") & (eff["row_method"] != "full")]
    full = eff[eff["system"] == "full"].assign(budget=FULL, row_method="full")
    points = pd.concat([frame.pivot_table(index=ID, columns="measure", values="value", aggfunc=how).reset_index()
                        for frame, how in ((method, "first"), (full, "median")) if len(frame)])
    if "kept_fraction" not in method or method.empty:
        return points
    kept = method.groupby(ID)["kept_fraction"].mean().rename("kept_fraction").reset_index()
    return points.merge(kept, on=ID, how="left")


def sample_points(predictions: pd.DataFrame) -> pd.DataFrame:
    """Median TPOT and max peak memory per context length of tasks with per-sample timings."""
    if "meta.context_length" not in predictions or "tpot_seconds" not in predictions:
        return pd.DataFrame(columns=ID)
    rows = predictions.dropna(subset=["meta.context_length", "tpot_seconds"])
    return rows.groupby(["task", "model", "budget", "row_method", "meta.context_length"]).agg(
        tpot_seconds=("tpot_seconds", "median"), peak_memory_bytes=("peak_memory_bytes", "max")).reset_index().rename(
        columns={"meta.context_length": "context_length"}).assign(batch="")


def _colours(methods: list[str]) -> dict:
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    compressed = [m for m in methods if m != "full"]
    return {"full": "black", **{m: cycle[i % len(cycle)] for i, m in enumerate(compressed)}}


def _line_style(method: str, colour: dict) -> dict:
    """The full cache dashed and on top (methods that match it do not hide it)."""
    full = method == "full"
    return dict(color=colour[method], linestyle="--" if full else "-", zorder=3 if full else 2)


def _panels(frame: pd.DataFrame) -> list[str]:
    return [m for m in PANELS if m in frame and frame[m].notna().any()]


def _lines(frame: pd.DataFrame, methods: list[str]):
    panels, colour = _panels(frame), _colours(methods)
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels) + 1.5, 3.3), squeeze=False,
                             layout="constrained")
    for ax, measure in zip(axes[0], panels):
        label, factor = PANELS[measure]
        for method in methods:
            line = frame[frame["row_method"] == method].sort_values("context_length")
            style = _line_style(method, colour)
            ax.plot(line["context_length"], factor * line[measure], marker="o",
                    label=_method_label(method, _kept(frame, method)), **style)
            if measure == "tpot_seconds" and "tpot_bound_seconds" in line and line["tpot_bound_seconds"].notna().any():
                ax.plot(line["context_length"], factor * line["tpot_bound_seconds"], color=colour[method],
                        linestyle=":", linewidth=1.2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if "tpot_bound_seconds" in frame and frame["tpot_bound_seconds"].notna().any():
        handles.append(Line2D([], [], color="grey", linestyle=":"))
        labels.append("bytes-read bound")
    axes[0][-1].legend(handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    return fig


def _bars(frame: pd.DataFrame, methods: list[str]):
    """One context length: a bar per method for each measure; TPOT bars carry the bound (black tick) and the
    achieved fraction bound / TPOT."""
    panels, colour = _panels(frame), _colours(methods)
    rows = frame.set_index("row_method").loc[methods]
    x = np.arange(len(methods))
    fig, axes = plt.subplots(1, len(panels), figsize=(max(3.0, 0.42 * len(methods)) * len(panels) + 1, 3.6),
                             squeeze=False, layout="constrained")
    for ax, measure in zip(axes[0], panels):
        label, factor = PANELS[measure]
        values = factor * rows[measure].to_numpy(dtype=float)
        ax.bar(x, values, color=[colour[m] for m in methods], width=0.7)
        if measure == "tpot_seconds" and "tpot_bound_seconds" in rows and rows["tpot_bound_seconds"].notna().any():
            bound = factor * rows["tpot_bound_seconds"].to_numpy(dtype=float)
            ax.scatter(x, bound, marker="_", s=300, color="black", linewidths=2, zorder=3)
            for i, (v, b) in enumerate(zip(values, bound)):
                if np.isfinite(v) and np.isfinite(b) and v > 0:
                    ax.annotate(f"{b / v:.2g}", (i, max(v, b)), textcoords="offset points", xytext=(0, 3),
                                ha="center", fontsize=6)
            axes[0][-1].legend([Line2D([], [], color="black", marker="_", markersize=12, linestyle="")],
                               ["bytes-read bound (above: bound / TPOT)"], fontsize=7, loc="center left",
                               bbox_to_anchor=(1.02, 0.5))
        ax.set_xticks(x, [_method_label(m, _kept(frame, m)) for m in methods], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel(label)
    return fig


def batch_points(predictions: pd.DataFrame) -> pd.DataFrame:
    """Decode tokens/s per batch size (median over tries that fitted) of every method and the full cache,
    and the smallest batch that ran out of memory (``failed``) per line."""
    if not {"system", "batch_size", "tpot_seconds"} <= set(predictions.columns):
        return pd.DataFrame()
    eff = predictions[predictions["task"].str.startswith(TASK) & predictions["system"].isin(["method", "full"])]
    fits = eff["fits"].fillna(True).astype(bool) if "fits" in eff else pd.Series(True, index=eff.index)
    eff = eff.assign(fits=fits, decode=eff["batch_size"] / eff["tpot_seconds"])
    eff = eff[(eff["system"] == "full") | (eff["row_method"] != "full")].copy()
    eff.loc[eff["system"] == "full", ["budget", "row_method"]] = [FULL, "full"]
    keys = ["task", "model", "budget", "row_method", "prompt_length"]
    fitted = eff[eff["fits"]].groupby(keys + ["batch_size"])["decode"].median().reset_index()
    failed = eff[~eff["fits"]].groupby(keys)["batch_size"].min().rename("failed").reset_index()
    return fitted.merge(failed, on=keys, how="outer")


def batch_figures(predictions: pd.DataFrame, order: list[str], out, formats) -> list:
    points, paths = batch_points(predictions), []
    for (task, length), task_points in (points.groupby(["task", "prompt_length"]) if len(points) else []):
        for model, budget, frame in _methods_by_budget(task_points):
            if frame.groupby("row_method")["batch_size"].nunique().max() < 2:
                continue
            methods = _ordered(frame["row_method"], order)
            colour = _colours(methods)
            fig, ax = plt.subplots(figsize=(6, 3.6), layout="constrained")
            for method in methods:
                line = frame[frame["row_method"] == method].dropna(subset=["batch_size"]).sort_values("batch_size")
                style = _line_style(method, colour)
                ax.plot(line["batch_size"], line["decode"], marker="o", label=_method_label(method), **style)
                failed = frame.loc[frame["row_method"] == method, "failed"].dropna()
                if len(failed):
                    ax.plot([failed.iloc[0]], [0.02], marker="x", color=colour[method], markersize=8,
                            transform=ax.get_xaxis_transform(), clip_on=False)
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
            ax.set_xlabel("batch size")
            ax.set_ylabel("decode tokens/s")
            ax.set_ylim(bottom=0)
            handles, labels = ax.get_legend_handles_labels()
            if frame["failed"].notna().any():
                handles.append(Line2D([], [], color="grey", marker="x", linestyle=""))
                labels.append("out of memory")
            ax.legend(handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
            ax.set_title(f"{task}: {display(model, MODEL_DISPLAY)}, budget {budget_display(budget)}, "
                         f"{int(length)} tokens", fontsize=10)
            paths += save(fig, out, _name("batch", task, model, budget, f"len{int(length)}"), formats)
    return paths
