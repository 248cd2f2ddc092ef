"""The papers' reported numbers (``kvbench/data/paper_results.csv``) in kvbench's names, and the display names
the papers' tables use for our models, methods, budgets and datasets.

Only rows whose model, method, budget and dataset all map are compared; everything else (ablation variants,
unnamed models, per-layer budgets, other benchmarks) stays in the CSV unmapped. Budgets "full"/"100%" are the
full cache. KVMerger Table 1's duplicated block ("35%?dup") is dropped (paper_tables.md)."""

from __future__ import annotations

from functools import lru_cache

import pandas as pd

from kvbench.tasks.longbench import CATEGORIES
from kvbench.tasks.sources import PACKAGE_DATA

PAPER_RESULTS = PACKAGE_DATA / "paper_results.csv"
FULL = "full"  # the budget label of full-cache rows in tables
KEPT = "kept"  # budget-label prefix of a block of rows aligned by realized kept fraction (report table.align)

# paper's model label -> kvbench model name (conf/model/<name>.yaml)
MODELS = {
    "Llama-2-7B-Chat": "llama2-7b-chat", "Llama2-7B-chat": "llama2-7b-chat",
    "Llama2-13B-chat": "llama2-13b-chat",
    "Llama-2-7B": "llama2-7b",
    "Llama-2-7B-32K": "llama2-7b-32k-instruct",  # Chelsea's ref. [24] is Together's Llama-2-7B-32K-Instruct
    "Llama-3-8B": "llama3-8b",
    "Llama-3-8B-Instruct": "llama3-8b-instruct",
    "Llama-3.1-8B-Instruct": "llama3.1-8b-instruct",
    "Mistral-7B-Instruct-v0.2": "mistral-7b-instruct-v0.2",
    "Mistral-7B": "mistral-7b-instruct-v0.2",  # D2O App.: the checkpoint is mistralai/Mistral-7B-Instruct-v0.2
    "LongChat-7B-v1.5-32k": "longchat-7b-v1.5-32k",
    "Qwen2-7B-Instruct": "qwen2-7b-instruct",
}
# paper's method label -> (kvbench method name, method hyperparameters the label implies)
METHODS = {
    "Full Cache": ("full", {}), "Full Model": ("full", {}), "Full": ("full", {}), "FullKV": ("full", {}),
    "H2O": ("h2o", {}), "CaM": ("cam", {}), "CAM": ("cam", {}), "StreamingLLM": ("streamingllm", {}),
    "StreamLLM": ("streamingllm", {}), "SnapKV": ("snapkv", {}), "PyramidKV": ("pyramidkv", {}),
    "TOVA": ("tova", {}), "D2O": ("d2o", {}), "KVMerger": ("kvmerger", {}), "Chelsea": ("chelsea", {}),
    "WeightedKV": ("weightedkv", {}), "EMS": ("ems", {}),
    "EMS(w.o. pos)": ("ems", {"positions": "without"}), "EMS(w. pos)": ("ems", {"positions": "with"}),
}
# paper's budget label -> kvbench budget label (``Budget.label``)
BUDGETS = {
    "full": FULL, "100%": FULL,
    "20%": "0.2", "20% of prompt": "0.2", "20% of (prompt + max decode length)": "0.2", "35%": "0.35", "50%": "0.5",
    **{f"{n} tokens/head": f"tokens{n}" for n in (64, 128, 256, 512, 768, 1024)},
}
# paper's metric label -> kvbench task and metric
METRICS = {"LongBench score": ("longbench", "score"), "ZeroScrolls score": ("zeroscrolls", "primary")}
# paper's dataset label -> kvbench dataset, per task (ZeroScrolls reuses LongBench's names for other data)
DATASETS = {
    "longbench": {
        "NrtvQA": "narrativeqa", "NarrativeQA": "narrativeqa", "narrativeqa": "narrativeqa",
        "Qasper": "qasper", "Qsper": "qasper", "qasper": "qasper",
        "MF-en": "multifieldqa_en", "MultiFieldQA-en": "multifieldqa_en", "multifieldqa_en": "multifieldqa_en",
        "multifieldqa.en": "multifieldqa_en", "MultiFieldQA-zh": "multifieldqa_zh",
        "HotpotQA": "hotpotqa", "2WikiMQA": "2wikimqa", "2wikimqa": "2wikimqa", "Musique": "musique",
        "DuReader": "dureader", "DuReader (zh)": "dureader",
        "GovReport": "gov_report", "gov_report": "gov_report", "gov.report": "gov_report", "QMSum": "qmsum",
        "MultiNews": "multi_news", "multi_news": "multi_news", "VCSUM (zh)": "vcsum",
        "TREC": "trec", "trec": "trec", "TriviaQA": "triviaqa", "triviaqa": "triviaqa", "SAMSum": "samsum",
        "LSHT(zh)": "lsht",
        "PCount": "passage_count", "Passage Count": "passage_count",
        "PRe": "passage_retrieval_en", "PassageRetrieval-en": "passage_retrieval_en", "pr_en": "passage_retrieval_en",
        "pr.en": "passage_retrieval_en", "PassageRetrieval-zh": "passage_retrieval_zh",
        "Lcc": "lcc", "LCC": "lcc", "RB-P": "repobench-p", "RepoBench-P": "repobench-p",
    },
    "zeroscrolls": {
        "gov_report": "gov_report", "SummScreenFD": "summ_screen_fd", "QMSum": "qmsum", "SQuALITY": "squality",
        "Qasper": "qasper", "NarrativeQA": "narrative_qa", "BookSumSort": "book_sum_sort",
    },
}

# kvbench name -> the short name the papers' tables print (EMS/Chelsea style for LongBench)
DATASET_DISPLAY = {
    "narrativeqa": "NrtvQA", "qasper": "Qasper", "multifieldqa_en": "MF-en", "multifieldqa_zh": "MF-zh",
    "hotpotqa": "HotpotQA", "2wikimqa": "2WikiMQA", "musique": "Musique", "dureader": "DuReader",
    "gov_report": "GovReport", "qmsum": "QMSum", "multi_news": "MultiNews", "vcsum": "VCSUM", "trec": "TREC",
    "triviaqa": "TriviaQA", "samsum": "SAMSum", "lsht": "LSHT", "passage_count": "PCount",
    "passage_retrieval_en": "PRe", "passage_retrieval_zh": "PRz", "lcc": "Lcc", "repobench-p": "RB-P",
    "summ_screen_fd": "SumScr", "squality": "SQuAL", "narrative_qa": "NrtvQA", "quality": "QuALITY",
    "space_digest": "SpaceDigest", "book_sum_sort": "BkSS", "niah": "NIAH", "passkey": "Passkey", "pg19": "PG19",
    **{f"avg:{c}": name for c, name in zip(CATEGORIES, ("SingleDoc", "MultiDoc", "Summ.", "FewShot", "Synth.",
                                                         "Code"))},
    "avg:overall": "Avg (datasets)", "avg:leaderboard_en": "Avg (leaderboard EN)",
    "avg:leaderboard_zh": "Avg (leaderboard ZH)", "avg:zeroscrolls": "Avg",
}
MODEL_DISPLAY = {
    "llama2-7b-chat": "Llama-2-7B-Chat", "llama2-13b-chat": "Llama-2-13B-Chat", "llama2-7b": "Llama-2-7B",
    "llama2-7b-32k-instruct": "Llama-2-7B-32K-Instruct", "llama3-8b": "Llama-3-8B",
    "llama3-8b-instruct": "Llama-3-8B-Instruct", "llama3.1-8b-instruct": "Llama-3.1-8B-Instruct",
    "mistral-7b-instruct-v0.2": "Mistral-7B-Instruct-v0.2", "longchat-7b-v1.5-32k": "LongChat-7B-v1.5-32k",
    "qwen2-7b-instruct": "Qwen2-7B-Instruct", "smollm2-135m-instruct": "SmolLM2-135M-Instruct",
    "tiny-llama-random": "tiny-llama (random)",
}
METHOD_DISPLAY = {
    "full": "Full Cache", "h2o": "H2O", "cam": "CaM", "streamingllm": "StreamingLLM", "snapkv": "SnapKV",
    "pyramidkv": "PyramidKV", "tova": "TOVA", "d2o": "D2O", "kvmerger": "KVMerger", "chelsea": "Chelsea",
    "weightedkv": "WeightedKV", "ems": "EMS",
}


def budget_display(label: str) -> str:
    """"0.2" -> "20%", "tokens256" -> "256 tokens/head", "full" -> "Full", "kept0.45" (a block of rows
    aligned by realized kept fraction) -> "kept ≈45%"."""
    if label == FULL:
        return "Full"
    if label.startswith("tokens"):
        return f"{label[len('tokens'):]} tokens/head"
    if label.startswith(KEPT):
        return f"kept ≈{float(label[len(KEPT):]) * 100:g}%"
    return f"{float(label) * 100:g}%"


def kept_display(kept: float) -> str:
    """Realized kept fraction (mean over samples of kept slots / prompt length) as shown beside a budget."""
    return "–" if kept is None or kept != kept else f"{kept:.2f}"


def display(name: str, table: dict) -> str:
    return table.get(name, name)


@lru_cache(maxsize=1)
def reference() -> pd.DataFrame:
    """Mapped, numeric paper rows: paper, table_id, model, budget, method, method_params (tuple of (key,
    value)), task, dataset, metric, value, notes."""
    raw = pd.read_csv(PAPER_RESULTS, dtype=str, keep_default_na=False)
    rows = []
    for r in raw.itertuples(index=False):
        task_metric = METRICS.get(r.metric)
        if task_metric is None or r.model not in MODELS or r.method not in METHODS or r.budget not in BUDGETS:
            continue
        task, metric = task_metric
        dataset = DATASETS[task].get(r.dataset)
        try:
            value = float(r.value)
        except ValueError:  # "OOM", "-", lost cells
            continue
        if dataset is None:
            continue
        method, params = METHODS[r.method]
        budget = FULL if method == "full" else BUDGETS[r.budget]
        rows.append({"paper": r.paper, "table_id": r.table_id, "model": MODELS[r.model], "budget": budget,
                     "method": method, "method_params": tuple(sorted(params.items())), "task": task,
                     "dataset": dataset, "metric": metric, "value": value, "notes": r.notes})
    return pd.DataFrame(rows)
