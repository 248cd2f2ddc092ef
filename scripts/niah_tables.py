"""The README's NIAH tables from collected results roots: one CSV row per run (method, budget, rouge1,
word_recall, realized kept fraction, prefill chunk size, commit), then the two markdown tables (before/after
the method fixes; chunked prefill minus one pass).

    python scripts/niah_tables.py --after /tmp/niah_after --before /tmp/niah_before \
        --chunked /tmp/niah_chunked --out results/niah_smollm2/niah_smollm2.csv

Each root is a kvbench ``results_root`` (its ``metrics.parquet``, rebuilt by ``kvbench collect ROOT``); several
roots per option let a re-run (say, one method after a fix, into its own root) replace the rows it covers in
the tables; the CSV keeps every run, with its commit.
Before/after cells are "—" where the method was not run before.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from kvbench.__main__ import CONF_DIR

METRICS = ("rouge1", "word_recall")
KEYS = ["code", "method", "budget", "prefill_chunk_size"]


def runs(root: Path, code: str) -> pd.DataFrame:
    """One row per run of ``root``: its metrics side by side."""
    rows = pd.read_parquet(root / "metrics.parquet")
    if "engine.prefill_chunk_size" not in rows:  # older code: every prompt in one pass
        rows["engine.prefill_chunk_size"] = None
    if "git_commit" not in rows:  # older code: only in each run's meta.json
        rows["git_commit"] = [json.loads((root / "runs" / r / "meta.json").read_text())["git_commit"]
                              for r in rows.run_id]
    rows = rows.assign(code=code, prefill_chunk_size=rows["engine.prefill_chunk_size"].astype("Int64"))
    scores = rows.pivot(index="run_id", columns="metric", values="value")
    wide = rows.drop_duplicates("run_id").join(scores, on="run_id")
    return wide[KEYS + list(METRICS) + ["kept_fraction", "n", "git_commit"]]


def fmt(value: float) -> str:
    return "" if pd.isna(value) else f"{value:.1f}"


def before_cell(old: pd.Series | None, column: str) -> str:
    """A before cell: "—" for a method not run before."""
    if old is None:
        return "—"
    return fmt(old[column]) if column in METRICS else f"{old[column]:.3f}"


def before_after(table: pd.DataFrame) -> str:
    one_pass = table[table.prefill_chunk_size.isna()]
    after = one_pass[one_pass.code == "after"].set_index(["method", "budget"])
    before = one_pass[one_pass.code == "before"].set_index(["method", "budget"])
    lines = ["| method | budget | rouge1 before | rouge1 after | word_recall before | word_recall after "
             "| kept before | kept after |", "|---|---|---|---|---|---|---|---|"]
    for (method, budget), row in after.iterrows():
        old = before.loc[(method, budget)] if (method, budget) in before.index else None
        lines.append(f"| {method} | {budget} | {before_cell(old, 'rouge1')} | {fmt(row.rouge1)} | "
                     f"{before_cell(old, 'word_recall')} | {fmt(row.word_recall)} | "
                     f"{before_cell(old, 'kept_fraction')} | {row.kept_fraction:.3f} |")
    return "\n".join(lines)


def chunked_change(table: pd.DataFrame) -> str:
    after = table[table.code == "after"]
    one = after[after.prefill_chunk_size.isna()].set_index(["method", "budget"])
    chunked = after[after.prefill_chunk_size.notna()]
    lines = ["| method | budget | chunk | rouge1 one pass | rouge1 chunked | Δ rouge1 | word_recall one pass "
             "| word_recall chunked | Δ word_recall | kept one pass | kept chunked |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for _, row in chunked.iterrows():
        base = one.loc[(row.method, row.budget)]
        lines.append(f"| {row.method} | {row.budget} | {row.prefill_chunk_size} | {fmt(base.rouge1)} | "
                     f"{fmt(row.rouge1)} | {row.rouge1 - base.rouge1:+.1f} | {fmt(base.word_recall)} | "
                     f"{fmt(row.word_recall)} | {row.word_recall - base.word_recall:+.1f} | "
                     f"{base.kept_fraction:.3f} | {row.kept_fraction:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for code in ("after", "before", "chunked"):
        parser.add_argument(f"--{code}", type=Path, nargs="+", required=True,
                            help=f"results roots of the {code} runs; a later root's run replaces an earlier one's")
    parser.add_argument("--out", type=Path, required=True, help="CSV to write")
    args = parser.parse_args()
    roots = [(root, "before") for root in args.before] + [(root, "after") for root in args.after + args.chunked]
    table = pd.concat([runs(root, code) for root, code in roots])
    order = list(OmegaConf.load(Path(CONF_DIR) / "report" / "default.yaml").table.method_order)  # the report's
    table = table.sort_values(["code", "prefill_chunk_size", "method", "budget"], ascending=[False, True, True, True],
                              key=lambda c: c.map(order.index) if c.name == "method" else c, na_position="first",
                              kind="stable")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out, index=False, float_format="%.6g")  # every run, replaced ones included
    latest = table.drop_duplicates(KEYS, keep="last")
    print(before_after(latest) + "\n")
    print(chunked_change(latest))

if __name__ == "__main__":
    main()
