"""Figures (matplotlib, PNG + PDF): NIAH/passkey heatmaps (depth x length), score vs budget, PG19 perplexity
vs position, realized kept ratio per layer x head. Efficiency figures are in ``efficiency.py``."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.colors import LinearSegmentedColormap  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from kvbench.report.paper import FULL, METHOD_DISPLAY, MODEL_DISPLAY, budget_display, display  # noqa: E402
from kvbench.report.render import column_display  # noqa: E402
from kvbench.report.tables import OURS, SUITE_AVERAGE, Table  # noqa: E402

# x-axis of score-vs-budget plots per budget kind; points are annotated with their realized kept fraction
BUDGET_AXIS = {"fraction": "budget (% of prompt; labels: realized kept fraction)",
               "kept": "realized kept fraction (%, rounded to the block)", "tokens": "budget (tokens per head)"}
# Red -> yellow -> green, the colours of Kamradt's needle-in-a-haystack figures that the papers reuse.
NEEDLE_CMAP = LinearSegmentedColormap.from_list("needle", ["#F0496E", "#EBB839", "#0CD79F"])


def _name(*parts) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", "_".join(str(p) for p in parts)).strip("_")


def save(fig, out: Path, name: str, formats) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.{fmt}" for fmt in formats]
    for path in paths:
        fig.savefig(path, bbox_inches="tight", dpi=150)
    plt.close(fig)
    return paths


def _methods_by_budget(frame: pd.DataFrame):
    """(model, budget, rows) per compressed budget, each with the model's full-cache rows added."""
    for (model, budget), group in frame[frame["budget"] != FULL].groupby(["model", "budget"]):
        full = frame[(frame["model"] == model) & (frame["budget"] == FULL)]
        yield model, budget, pd.concat([full, group])
    if (frame["budget"] != FULL).sum() == 0:
        for model, group in frame.groupby("model"):
            yield model, FULL, group


def _ordered(methods, order: list[str]) -> list[str]:
    """Distinct row methods, full cache first, then in ``order`` (the table's method order), then by name."""
    rank = {m: i for i, m in enumerate(order)}
    base = lambda m: m.split("[")[0].split("@")[0]  # noqa: E731
    return sorted(dict.fromkeys(methods), key=lambda m: (base(m) != "full", rank.get(base(m), len(rank)), m))


def _method_label(method: str, kept: float = float("nan")) -> str:
    """Display name of a row method, with its budget when rows are aligned by kept fraction ("@label") and
    its realized kept fraction when known."""
    method, at, budget = method.partition("@")
    base, bracket, rest = method.partition("[")
    label = display(base, METHOD_DISPLAY) + (f" [{rest}" if bracket else "")
    label += f" @ {budget_display(budget)}" if at else ""
    return label if kept != kept or base == "full" else f"{label} (kept {kept:.2f})"


def _kept(rows: pd.DataFrame, method: str) -> float:
    """Mean realized kept fraction of a row method's rows (NaN when the results predate the column)."""
    if "kept_fraction" not in rows:
        return float("nan")
    return float(rows.loc[rows["row_method"] == method, "kept_fraction"].mean())


def needle_heatmaps(predictions: pd.DataFrame, metric_of: dict, order: list[str], out: Path, formats) -> list[Path]:
    """Per task x model x budget: one depth x context-length heatmap of the mean score (%) per method."""
    paths = []
    cells = predictions.dropna(subset=["meta.context_length", "meta.depth"]) if "meta.depth" in predictions else []
    for task, frame in (cells.groupby("task") if len(cells) else []):
        metric = metric_of.get(task) or next(c[7:] for c in frame.columns if c.startswith("metric.") and frame[c].notna().any())
        for model, budget, rows in _methods_by_budget(frame):
            methods = _ordered(rows["row_method"], order)
            fig, axes = plt.subplots(1, len(methods), figsize=(3.2 * len(methods) + 1, 3.4), squeeze=False,
                                     layout="constrained")
            for ax, method in zip(axes[0], methods):
                grid = rows[rows["row_method"] == method].pivot_table(
                    index="meta.depth", columns="meta.context_length", values=f"metric.{metric}", aggfunc="mean") * 100
                image = ax.imshow(grid.to_numpy(), cmap=NEEDLE_CMAP, vmin=0, vmax=100, aspect="auto")
                ax.set_xticks(range(grid.shape[1]), [f"{int(x)}" for x in grid.columns], rotation=45)
                ax.set_yticks(range(grid.shape[0]), [f"{y:g}" for y in grid.index])
                if grid.size <= 100:
                    for (i, j), v in np.ndenumerate(grid.to_numpy()):
                        ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7)
                ax.set_title(_method_label(method, _kept(rows, method)), fontsize=9)
                ax.set_xlabel("context length (tokens)")
            axes[0][0].set_ylabel("needle depth (%)")
            fig.colorbar(image, ax=axes[0].tolist(), label=f"{metric} (%)")
            fig.suptitle(f"{task}: {display(model, MODEL_DISPLAY)}, budget {budget_display(budget)}", fontsize=10)
            paths += save(fig, out, _name("needle", task, model, budget), formats)
    return paths


def score_vs_budget(table: Table, budgets: pd.DataFrame, out: Path, formats) -> list[Path]:
    """Per model: the table's summary columns (overall/category averages, else the dataset columns) against
    the budget, one line per method, the full cache as a dashed line; fractions and token budgets apart.
    Every point is labelled with its realized kept fraction."""
    summary = [c for c in table.values.columns if c not in table.data_columns] or table.data_columns[:8]
    summary = [SUITE_AVERAGE[table.task]] if SUITE_AVERAGE.get(table.task) in summary else summary
    values = table.values[table.values.index.get_level_values("source") == OURS]
    paths = []
    for model, frame in values.groupby(level="model"):
        kinds = budgets[(budgets["model"] == model) & (budgets["budget"] != FULL)]
        for kind, kind_budgets in kinds.groupby("budget_kind"):
            value_of = dict(zip(kind_budgets["budget"], kind_budgets["budget_value"]))
            fig, axes = plt.subplots(1, len(summary), figsize=(4 * len(summary), 3.2), squeeze=False,
                                     layout="constrained")
            for ax, column in zip(axes[0], summary):
                for method, rows in frame.groupby(level="method"):
                    if method == "full":
                        for value in rows[column]:
                            ax.axhline(value, color="black", linestyle="--", label="Full Cache")
                        continue
                    points = sorted((value_of[row[1]], v, table.kept[row]) for row, v in rows[column].items()
                                    if row[1] in value_of)
                    if points:
                        x, y, kept = zip(*points)
                        x = [100 * v for v in x] if kind != "tokens" else x
                        ax.plot(x, y, marker="o", label=_method_label(method))
                        for xi, yi, ki in zip(x, y, kept):
                            if ki == ki:
                                ax.annotate(f"{ki:.2f}", (xi, yi), textcoords="offset points", xytext=(3, 3), fontsize=6)
                ax.set_xlabel(BUDGET_AXIS.get(kind, "budget (tokens per head)"))
                ax.set_title(column_display(column), fontsize=9)
            axes[0][0].set_ylabel(table.column_metric.get(summary[0], (None, "average score"))[1])
            axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
            fig.suptitle(f"{table.task}: {display(model, MODEL_DISPLAY)}", fontsize=10)
            paths += save(fig, out, _name("budget", table.task, model, kind), formats)
    return paths


def perplexity_curves(metrics: pd.DataFrame, prefix: str, out: Path, formats) -> list[Path]:
    """PG19: perplexity at position k (``ppl_window@k`` or ``ppl@k`` rows) per method and budget."""
    rows = metrics[(metrics["task"] == "pg19") & metrics["metric"].str.startswith(f"{prefix}@")]
    rows = rows.assign(position=rows["metric"].str.split("@").str[1].astype(int))
    paths = []
    for model, budget, frame in (_methods_by_budget(rows) if len(rows) else []):
        fig, ax = plt.subplots(figsize=(5.5, 3.5), layout="constrained")
        for (method, dataset), line in frame.groupby(["row_method", "dataset"]):
            line = line.sort_values("position")
            ax.plot(line["position"], line["value"], label=_method_label(method, _kept(line, method)),
                    linestyle="--" if method == "full" else "-")
        ax.set_xlabel("token position")
        ax.set_ylabel("perplexity" + (" (window)" if prefix == "ppl_window" else " (cumulative)"))
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
        ax.set_title(f"PG19: {display(model, MODEL_DISPLAY)}, budget {budget_display(budget)}", fontsize=10)
        paths += save(fig, out, _name("pg19", model, budget), formats)
    return paths


def kept_ratio(predictions: pd.DataFrame, order: list[str], out: Path, formats) -> list[Path]:
    """Realized kept fraction per layer x KV head (mean over samples of kept / prompt length) per method.
    Methods that keep the same fraction in every layer and head get no heatmap (it would be one colour):
    the title lists their fraction; a figure where all are uniform is not drawn."""
    paths = []
    frame = predictions.dropna(subset=["kept_per_layer_head"]) if "kept_per_layer_head" in predictions else []
    for task, rows_task in (frame.groupby("task") if len(frame) else []):
        for model, budget, rows in _methods_by_budget(rows_task):
            grids = {}
            for method in _ordered(rows["row_method"], order):
                sel = rows[rows["row_method"] == method]
                grids[method] = np.stack([np.stack(list(k)).astype(float) / n
                                          for k, n in zip(sel["kept_per_layer_head"], sel["prompt_length"])]).mean(axis=0)
            shown = {m: g for m, g in grids.items() if not np.allclose(g, g.flat[0])}
            if not shown:
                continue
            fig, axes = plt.subplots(1, len(shown), figsize=(3 * len(shown) + 1, 3.4), squeeze=False,
                                     layout="constrained")
            vmax = max(1.0, max(g.max() for g in shown.values()))
            for ax, (method, grid) in zip(axes[0], shown.items()):
                image = ax.imshow(grid, cmap="viridis", vmin=0, vmax=vmax, aspect="auto")
                ax.set_title(f"{_method_label(method)} (mean {grid.mean():.2f})", fontsize=9)
                ax.set_xlabel("KV head")
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            axes[0][0].set_ylabel("layer")
            fig.colorbar(image, ax=axes[0].tolist(), label="kept / prompt length")
            uniform = [f"{_method_label(m)} {g.flat[0]:.2f}" for m, g in grids.items() if m not in shown]
            title = f"{task}: {display(model, MODEL_DISPLAY)}, budget {budget_display(budget)}"
            fig.suptitle(title + (f"\nsame in every layer and head: {', '.join(uniform)}" if uniform else ""),
                         fontsize=10)
            paths += save(fig, out, _name("kept", task, model, budget), formats)
    return paths
