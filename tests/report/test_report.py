"""The report on a synthetic results root: tables parsed back and checked against the parquet, paper rows
against the shipped CSV, statistics, filters, plots."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest

from kvbench.report import data, main
from kvbench.report.paper import PAPER_RESULTS
from kvbench.report.stats import bootstrap_ci, paired_permutation_pvalue
from tests.report.synthetic import MODEL, make_results


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = make_results(tmp_path_factory.mktemp("results"))
    assert main(["--root", str(root), "--ci", "--pvalues", "--no-plots"]) == 0
    return root


@pytest.fixture(scope="module")
def plotted(root):
    """Plots of one budget (plus the full cache) only: figures take most of the report's time."""
    assert main(["--root", str(root), "--out", str(root / "plotted"), "--budget", "tokens256"]) == 0
    return root / "plotted"


def table_csv(root, task):
    return pd.read_csv(root / "report" / "tables" / f"{task}.csv", keep_default_na=False, na_values=[""])


def ours(frame):
    return frame[frame["source"] == "ours"].set_index(["budget", "method"])


def test_longbench_cells_equal_parquet_metric_rows(root):
    metrics = pd.read_parquet(root / "metrics.parquet")
    table = ours(table_csv(root, "longbench"))
    lb = metrics[(metrics.task == "longbench") & ~metrics.dataset.str.startswith("avg:")]
    checked = 0
    for r in lb.to_dict("records"):
        budget = "full" if r["method"] == "full" else r["budget"]
        method = f"ems[positions={r['method.positions']}]" if r["method"] == "ems" else r["method"]
        assert table.at[(budget, method), r["dataset"]] == pytest.approx(r["value"])
        checked += 1
    assert checked == 8 * 4  # 8 runs (two full runs share one row) x 4 datasets
    # by hand: full = per-sample means x 100 of FIXED_SCORES; averages = means of the dataset columns
    assert table.at[("full", "full"), "narrativeqa"] == pytest.approx(20.0)
    assert table.at[("0.5", "h2o"), "qasper"] == pytest.approx(30.0)
    assert table.at[("0.5", "h2o"), "avg:single_doc_qa"] == pytest.approx(25.0)
    assert table.at[("0.5", "h2o"), "avg:overall"] == pytest.approx((20 + 30 + 33.33 + 33.33) / 4)
    # the task's own overall average (rounded) agrees with the recomputed one
    own = metrics[(metrics.task == "longbench") & (metrics.dataset == "avg:overall") & (metrics.method == "h2o")
                       & (metrics.budget == "0.5")]
    assert own["value"].iloc[0] == pytest.approx(table.at[("0.5", "h2o"), "avg:overall"], abs=0.01)
    # the official leaderboard's Avg: mean of the category means (single-doc QA, multi-doc QA, few-shot)
    row = table.loc[("0.5", "h2o")]
    expected = ((row["narrativeqa"] + row["qasper"]) / 2 + row["hotpotqa"] + row["trec"]) / 3
    assert row["avg:leaderboard_en"] == pytest.approx(expected) and row["avg:leaderboard_en"] != row["avg:overall"]
    full_avg = (20 + 40 + 50 + 66.67) / 4  # dataset scores are rounded to 2 decimals by the task
    assert table.at[("0.5", "h2o"), "Δ vs Full"] == pytest.approx((20 + 30 + 33.33 + 33.33) / 4 - full_avg)


def test_every_table_names_its_query_mode(root):
    for path in sorted((root / "report" / "tables").glob("*.md")):
        if path.stem.endswith("_pvalues"):
            continue
        assert path.read_text().splitlines()[0].startswith("Query mode: "), path.name  # unrecorded: hand-made rows
    assert (root / "report" / "tables" / "longbench.md").read_text().startswith("Query mode: official.\n")
    assert "## longbench (query mode: official)" in (root / "report" / "report.md").read_text()
    assert set(table_csv(root, "longbench")["mode"]) == {"official"}


def md_rows(path):
    lines = [line for line in path.read_text().splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return header, [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]]


def test_markdown_bold_marks_best_of_each_block(root):
    header, rows = md_rows(root / "report" / "tables" / "longbench.md")
    table = ours(table_csv(root, "longbench"))
    block = table.loc["tokens256"]
    col = header.index("NrtvQA")
    best = block["narrativeqa"].max()
    for row in rows:
        if row[1] != "256 tokens/head" or "paper" in row[3]:
            continue
        value = float(re.match(r"\**([\d.]+)", row[col]).group(1))
        assert row[col].startswith("**") == (abs(value - round(best, 2)) < 1e-9), row
    full = next(r for r in rows if r[3] == "Full Cache")
    assert "**" not in "".join(full)  # the full cache is the reference, never "best"
    assert header[-1] == "Δ vs Full" and header[4:9] == ["n", "NrtvQA", "Qasper", "HotpotQA", "TREC"]
    assert all(r[4] == "3" for r in rows if "paper" not in r[3])  # 3 samples per dataset
    # the realized kept fraction stands beside the budget label (synthetic runs: 1.0 full, 0.2 compressed)
    assert header[1:4] == ["Budget", "Kept", "Method"] and full[2] == "1.00"
    assert {r[2] for r in rows if r[1] != "Full" and "paper" not in r[3]} == {"0.20"}
    assert {r[2] for r in rows if "paper" in r[3]} == {"–"}


def test_latex_is_booktabs_with_one_line_per_row(root):
    tex = (root / "report" / "tables" / "longbench.tex").read_text()
    for rule in (r"\toprule", r"\midrule", r"\bottomrule", r"\begin{tabular}"):
        assert rule in tex
    body = [line for line in tex.splitlines() if line.endswith(r"\\")][1:]
    assert len(body) == len(table_csv(root, "longbench"))
    assert r"\textbf{" in tex and "256 tokens/head" in tex and r"20\%" not in tex and r"50\%" in tex


def test_paper_rows_come_from_the_shipped_csv(root):
    raw = pd.read_csv(PAPER_RESULTS)
    table = table_csv(root, "longbench").set_index(["budget", "method", "source"])
    ems = raw[(raw.paper == "ems") & (raw.table_id == "table1") & (raw.model == "Llama-2-7B-Chat")]
    h2o = ems[ems.method == "H2O"].set_index("dataset")["value"].astype(float)
    assert table.at[("tokens256", "h2o", "paper:ems/table1"), "narrativeqa"] == pytest.approx(h2o["NrtvQA"])
    assert table.at[("tokens256", "h2o", "paper:ems/table1"), "trec"] == pytest.approx(h2o["TREC"])
    with_pos = ems[ems.method == "EMS(w. pos)"].set_index("dataset")["value"].astype(float)
    assert table.at[("tokens256", "ems[positions=with]", "paper:ems/table1"), "qasper"] == pytest.approx(with_pos["Qasper"])
    kvm = raw[(raw.paper == "kvmerger") & (raw.table_id == "table1") & (raw.model == "Llama2-7B-chat")
              & (raw.method == "H2O") & (raw.budget == "50%")].set_index("dataset")["value"].astype(float)
    assert table.at[("0.5", "h2o", "paper:kvmerger/table1"), "narrativeqa"] == pytest.approx(kvm["narrativeqa"])
    assert ("tokens128", "h2o", "paper:ems/table1") not in table.index  # EMS Table 1 is at 256 only


def test_align_by_kept_reblocks_rows_by_realized_kept_fraction():
    metrics = pd.DataFrame({"run_id": ["a", "b", "c", "d"], "model": "m", "method": ["full", "h2o", "kvmerger", "kvmerger"],
                            "row_method": ["full", "h2o", "kvmerger", "kvmerger"], "budget": ["full", "0.5", "0.5", "0.2"],
                            "budget_kind": "fraction", "budget_value": [1.0, 0.5, 0.5, 0.2],
                            "kept_fraction": [1.0, 0.5, 0.466, 0.31]})
    out = data.align_by_kept(metrics, 0.05)
    # step 0.05: 0.466 -> round(9.32) x 0.05 = 0.45, 0.31 -> 0.3; step 0.1: 0.466 -> 0.5, beside h2o at 0.5
    assert out.budget.tolist() == ["full", "kept0.5", "kept0.45", "kept0.3"]
    assert out.row_method.tolist() == ["full", "h2o@0.5", "kvmerger@0.5", "kvmerger@0.2"]
    assert out.budget_kind.tolist() == ["fraction", "kept", "kept", "kept"]
    assert data.align_by_kept(metrics, 0.1).budget.tolist() == ["full", "kept0.5", "kept0.5", "kept0.3"]


def test_tables_line_methods_up_by_realized_kept_fraction(root, tmp_path):
    out = tmp_path / "kept"
    assert main(["--root", str(root), "--out", str(out), "--task", "longbench", "--no-plots", "table.align=kept"]) == 0
    table = pd.read_csv(out / "tables" / "longbench.csv", keep_default_na=False, na_values=[""])
    compressed = table[table.budget != "full"]
    assert set(compressed.budget) == {"kept0.2"}  # the synthetic runs keep 0.2 whatever their label
    assert {"h2o@0.5", "h2o@tokens256", "h2o@tokens128", "snapkv@tokens256"} <= set(compressed.method)
    assert (compressed.source == "ours").all() and (compressed.kept_fraction == 0.2).all()
    header, rows = md_rows(out / "tables" / "longbench.md")
    assert ["Full", "1.00", "Full Cache"] in [r[1:4] for r in rows]
    assert ["kept ≈20%", "0.20", "H2O @ 50%"] in [r[1:4] for r in rows]


def test_bootstrap_intervals_and_pvalues():
    assert bootstrap_ci([0.4] * 5) == pytest.approx((40.0, 40.0))
    lo, hi = bootstrap_ci([0.0, 1.0] * 50, resamples=2000)
    assert 38 < lo < 50 < hi < 62  # 50 +- 1.96 * 5
    assert paired_permutation_pvalue([0.3, 0.5, 0.1], [0.3, 0.5, 0.1]) == 1.0
    assert paired_permutation_pvalue(np.ones(40), np.zeros(40), resamples=999) == pytest.approx(1 / 1000)
    assert paired_permutation_pvalue([1, 0] * 20, [0, 1] * 20) > 0.5  # equal means


def test_ci_and_pvalue_columns(root):
    table = ours(table_csv(root, "longbench"))
    lo, hi = table.at[("full", "full"), "narrativeqa:ci_lo"], table.at[("full", "full"), "narrativeqa:ci_hi"]
    assert 10.0 <= lo <= 20.0 <= hi <= 30.0  # samples 0.1, 0.2, 0.3
    pvalues = pd.read_csv(root / "report" / "tables" / "longbench_pvalues.csv")
    vs_full = pvalues[pvalues.budget_b == "full"]
    assert len(vs_full) == 6 * 4  # every compressed row (h2o x 3 budgets, snapkv, ems x 2) x dataset
    assert pvalues["p_value"].between(0, 1).all()
    row = vs_full[(vs_full.method_a == "h2o") & (vs_full.budget == "0.5") & (vs_full.dataset == "qasper")].iloc[0]
    assert row.delta == pytest.approx(30.0 - 40.0)
    assert table.at[("0.5", "h2o"), "qasper:p_vs_full"] == pytest.approx(row.p_value)
    within = pvalues[(pvalues.budget == "tokens256") & (pvalues.budget_b == "tokens256")]
    assert len(within) == 4 * 3 // 2 * 4  # pairs of the 4 methods at 256, per dataset


def test_pg19_and_efficiency_tables(root):
    pg19 = ours(table_csv(root, "pg19"))
    assert pg19.at[("full", "full"), "pg19"] == pytest.approx(8.5)
    assert pg19.at[("tokens256", "h2o"), "Δ vs Full"] == pytest.approx(1.0)
    assert bool(pg19.at[("tokens128", "h2o"), "pg19:best"])
    eff = ours(table_csv(root, "efficiency"))
    assert eff.at[("tokens256", "snapkv"), "len2048_bs1/method.tpot_seconds"] == pytest.approx(0.5 * 2048e-5)
    md = (root / "report" / "tables" / "efficiency.md").read_text()
    assert "(ms)" in md and "(GiB)" in md and "10.24" in md  # 2048e-5 s shown in ms


def test_filters_keep_full_reference_and_reject_unknown_values(root, tmp_path, capsys):
    out = tmp_path / "filtered"
    assert main(["--root", str(root), "--out", str(out), "--task", "longbench", "--budget", "0.5", "--no-plots",
                 "--no-paper"]) == 0
    table = pd.read_csv(out / "tables" / "longbench.csv")
    assert sorted(zip(table.budget, table.method)) == [("0.5", "h2o"), ("full", "full")]
    assert not (out / "tables" / "passkey.csv").exists()
    assert main(["--root", str(root), "--out", str(out), "--method", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "nosuch" in err and "h2o" in err
    assert main(["--root", str(tmp_path / "missing")]) == 2


@pytest.mark.parametrize("kind", ["needle_passkey", "budget_longbench", "pg19", "kept_longbench", "efficiency_efficiency"])
def test_every_plot_kind_is_written_as_png_and_pdf(plotted, kind):
    plots = plotted / "plots"
    pngs = sorted(plots.glob(f"{kind}_{MODEL}_*.png"))
    assert pngs, kind
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
        assert png.with_suffix(".pdf").read_bytes()[:5] == b"%PDF-"
    assert f"plots/{pngs[0].name}" in (plotted / "report.md").read_text()
