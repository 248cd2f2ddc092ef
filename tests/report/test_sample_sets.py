"""The report compares methods on the same samples: of runs with different ``limit`` it keeps the one scored
on the full cache's samples, marks rows scored on other samples (no Δ, not ranked, a warning), prints n,
and tests significance with a paired permutation test on the shared samples."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from kvbench import store
from kvbench.report import main
from kvbench.report.stats import PAIRED_TEST, paired_permutation_pvalue
from kvbench.runner import sample_ids_hash
from kvbench.tasks.base import Task
from tests.report.test_report import md_rows

SCORES = {"full": [1, 1, 0, 1, 0, 1], "h2o": [1, 0, 0, 1, 0, 0], "snapkv": [1, 1, 1, 1, 1, 1]}


def write(root, method: str, limit: int, budget: str = "0.5") -> None:
    rid = store.run_id({"method": method, "limit": limit, "budget": budget})
    predictions = pd.DataFrame({"run_id": rid, "sample_id": [f"passkey-{i}" for i in range(limit)],
                                "dataset": "passkey", "metric.exact_match": [float(v) for v in SCORES[method][:limit]]})
    full = method == "full"
    run = {"run_id": rid, "model": "tiny", "method": method, "budget": "full" if full else budget,
           "budget_kind": "full" if full else "fraction", "budget_value": np.nan if full else float(budget),
           "task": "passkey", "limit": limit, "n_samples": limit, "kept_fraction": 0.5, "tpot_seconds": 0.01}
    metrics = pd.DataFrame([{**run, **row, "sample_ids_hash": sample_ids_hash(predictions, row["dataset"])}
                            for row in Task().aggregate(predictions)])
    store.write_run(root, rid, "{}", predictions, metrics, {"run_id": rid})


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("results")
    for method, limit in [("full", 6), ("h2o", 2), ("h2o", 6), ("snapkv", 2)]:
        write(root, method, limit)
    return root


def test_rows_are_aligned_on_the_full_caches_samples_and_others_are_marked(report, capsys):
    assert main(["--root", str(report), "--no-plots", "--pvalues", "--ci"]) == 0
    err = capsys.readouterr().err
    table = pd.read_csv(report / "report" / "tables" / "passkey.csv").set_index(["budget", "method"])
    # h2o ran on 2 and on 6 samples: the 6-sample run (the full cache's samples) is the one shown
    assert table.at[("0.5", "h2o"), "passkey"] == pytest.approx(100 * 2 / 6, abs=0.01)
    assert table.at[("0.5", "h2o"), "passkey:n"] == 6
    assert table.at[("0.5", "h2o"), "Δ vs Full"] == pytest.approx(100 * (2 - 4) / 6, abs=0.05)
    # snapkv ran on 2 samples only: marked, no delta, not ranked best although its score is highest
    assert bool(table.at[("0.5", "snapkv"), "passkey:other_samples"])
    assert np.isnan(table.at[("0.5", "snapkv"), "Δ vs Full"])
    assert not table.at[("0.5", "snapkv"), "passkey:best"]
    assert "tiny / snapkv / 0.5 was scored on other samples than the full cache in passkey (n = 2)" in err
    header, rows = md_rows(report / "report" / "tables" / "passkey.md")
    n_of = {r[3]: r[4] for r in rows}  # Model, Budget, Kept, Method, n, ...
    assert header[4] == "n" and n_of["Full Cache"] == "6" and n_of["SnapKV"] == "2"
    snapkv = next(r for r in rows if r[3] == "SnapKV")
    assert "‡" in snapkv[5]
    text = (report / "report" / "tables" / "passkey.md").read_text()
    assert "‡: scored on other samples than the full cache" in text and PAIRED_TEST in text
    assert "## Caveats" in (report / "report" / "report.md").read_text()


def test_pvalues_are_paired_permutation_tests_on_the_shared_samples(report):
    main(["--root", str(report), "--no-plots", "--pvalues"])
    pvalues = pd.read_csv(report / "report" / "tables" / "passkey_pvalues.csv")
    row = pvalues[(pvalues.method_a == "snapkv") & (pvalues.budget_b == "full")].iloc[0]
    assert row.n == 2 and row.test == PAIRED_TEST  # the 2 samples both scored
    assert row.p_value == pytest.approx(paired_permutation_pvalue([1, 1], [1, 1]))


def test_three_samples_can_never_be_significant():
    """The exact test's smallest p-value with n samples is 2 / 2^n: 0.25 for n = 3 (a bootstrap test gave
    p ~ 0.001 here, and the table marked the difference significant)."""
    assert paired_permutation_pvalue([1, 1, 1], [0, 0, 0]) == pytest.approx(0.25)
    assert paired_permutation_pvalue([1] * 8, [0] * 8) == pytest.approx(2 / 2**8)
    # by hand, n = 2, differences (1, 0): sign vectors give |mean| 0.5, 0.5, 0.5, 0.5 -> p = 1
    assert paired_permutation_pvalue([1, 0], [0, 0]) == pytest.approx(1.0)
    # differences (2, 1): |mean| over (+,+) (+,-) (-,+) (-,-) = 1.5, 0.5, 0.5, 1.5 -> p = 2/4
    assert paired_permutation_pvalue([2, 1], [0, 0]) == pytest.approx(0.5)
