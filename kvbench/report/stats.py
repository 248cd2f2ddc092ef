"""Statistics over per-sample scores: bootstrap percentile intervals (Efron) and a paired sign-flip
permutation test (Fisher's randomization test, as Dror et al. 2018 recommend for comparing NLP systems on the
same samples; exact for small n, where a bootstrap test is far too eager: 3 samples can give it p < 0.05).

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


PAIRED_TEST = "paired sign-flip permutation test"
EXACT_MAX_SAMPLES = 16  # up to here every one of the 2^n sign vectors is enumerated


def paired_permutation_pvalue(a, b, resamples: int = 1000, seed: int = 0) -> float:
    """Two-sided p-value of mean(a) == mean(b), where a[i] and b[i] score the same sample.

    Under the null each difference d_i = a_i - b_i is as likely to have the other sign, so p is the share of
    sign vectors s with |mean(s * d)| >= |mean(d)|: all 2^n of them for n <= EXACT_MAX_SAMPLES (the smallest
    possible p is 2 / 2^n: 0.25 at n = 3), else ``resamples`` random ones with +1 smoothing."""
    diff = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    n = len(diff)
    if n == 0:
        return float("nan")
    observed = abs(diff.mean()) - 1e-12
    if n <= EXACT_MAX_SAMPLES:
        signs = ((np.arange(2**n)[:, None] >> np.arange(n)) & 1) * 2 - 1
        return float(np.mean(np.abs(signs @ diff) / n >= observed))
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=(resamples, n))
    extreme = np.count_nonzero(np.abs(signs @ diff) / n >= observed)
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
