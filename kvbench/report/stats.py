"""Bootstrap statistics over per-sample scores (Efron percentile intervals; paired bootstrap test after
Berg-Kirkpatrick et al. 2012 / Koehn 2004).

A dataset score is ``100 * mean`` of the per-sample ``metric.<name>`` values (Task.aggregate), so every
statistic here resamples samples, not runs. Metrics without per-sample values (perplexity, geometric means of
ROUGE, averages over datasets) get none."""

from __future__ import annotations

import numpy as np
import pandas as pd


def resample_means(values: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    """(n,) per-sample values -> (resamples,) means of samples drawn with replacement."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(values), size=(resamples, len(values)))
    return values[idx].mean(axis=1)


def bootstrap_ci(values, resamples: int = 1000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of ``100 * mean(values)``; (nan, nan) for no values."""
    values = np.asarray(values, dtype=float)
    values = values[~np.isnan(values)]
    if len(values) == 0:
        return float("nan"), float("nan")
    means = 100 * resample_means(values, resamples, seed)
    tail = (1 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def paired_pvalue(a, b, resamples: int = 1000, seed: int = 0) -> float:
    """Two-sided paired bootstrap p-value of mean(a) != mean(b); a[i], b[i] score the same sample.

    The bootstrap distribution of the mean difference, shifted to mean 0 (the null), is compared with the
    observed difference: p = P(|d* - d| >= |d|), with +1 smoothing so p is never exactly 0."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    diff = a - b
    observed = diff.mean()
    boot = resample_means(diff, resamples, seed)
    extreme = np.count_nonzero(np.abs(boot - observed) >= abs(observed) - 1e-12)
    return float((extreme + 1) / (resamples + 1))


def per_sample(predictions: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Wide per-sample table of one metric: index (task, model, dataset, sample_id), one column per
    (budget, row_method); NaN where a row lacks the sample."""
    column = f"metric.{metric}"
    if column not in predictions:
        return pd.DataFrame()
    frame = predictions.dropna(subset=[column])
    return frame.pivot_table(index=["task", "model", "dataset", "sample_id"], columns=["budget", "row_method"],
                             values=column, aggfunc="first")
