"""LongBench and LongBench-E (Bai et al. 2023), reproducing THUDM/LongBench ``pred.py`` + ``eval.py``.

Two named modes, recorded in ``task.mode`` and every sample's ``meta.mode``:
* ``official``: the official prompt (``dataset2prompt.json``, typos included), middle truncation of the raw
  prompt tokens to ``max_length`` (``lm.longbench_max_length`` unless set), the chat template except for
  trec/triviaqa/samsum/lsht/lcc/repobench-p, all of it prefilled (and compressed) at once;
* ``query_agnostic`` (kvpress style): the prompt is split right after ``{context}``; the part up to there is
  prefilled and compressed alone, the rest (question, closing instruction, chat-template tail) is fed as
  ``Prompt.suffix_ids`` afterwards. Only the context part is middle-truncated, so the question always stays.

Greedy decoding with ``dataset2maxlen.json``; samsum also stops at a newline and generates >= 1 token.
Scoring (``score_sample``): first line only for trec/triviaqa/samsum/lsht, max over answers of the dataset's
metric. Dataset score ``round(100 * mean, 2)``; LongBench-E also per length bucket (<4k, 4-8k, 8k+ of the
``length`` field). Extra rows, each named: ``avg:<category>`` (mean of the category's dataset scores),
``avg:overall`` (mean of all dataset scores, what KV-cache papers print as "Avg") and
``avg:leaderboard_en`` / ``avg:leaderboard_zh`` (the official leaderboard's "Avg": per language, the mean of
its category averages; [I] the code datasets count as English, the leaderboard's English table holds them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import ClassVar

import pandas as pd

from kvbench.errors import ConfigError, unknown_name
from kvbench.tasks.base import MODES, Prompt, Sample, Task, encode_parts
from kvbench.tasks.longbench_metrics import DATASET2METRIC, FIRST_LINE_DATASETS
from kvbench.tasks.sources import PACKAGE_DATA, DataRef, check_source, load_records

TABLES = PACKAGE_DATA / "longbench"
SAMPLE_DIR = TABLES / "sample"
DATASET2PROMPT: dict[str, str] = json.loads((TABLES / "dataset2prompt.json").read_text(encoding="utf-8"))
DATASET2MAXLEN: dict[str, int] = json.loads((TABLES / "dataset2maxlen.json").read_text(encoding="utf-8"))
HUB_ID = "THUDM/LongBench"

CATEGORIES = {
    "single_doc_qa": ("narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh"),
    "multi_doc_qa": ("hotpotqa", "2wikimqa", "musique", "dureader"),
    "summarization": ("gov_report", "qmsum", "multi_news", "vcsum"),
    "few_shot": ("trec", "triviaqa", "samsum", "lsht"),
    "synthetic": ("passage_count", "passage_retrieval_en", "passage_retrieval_zh"),
    "code": ("lcc", "repobench-p"),
}
CATEGORY_OF = {d: c for c, datasets in CATEGORIES.items() for d in datasets}
CHINESE_DATASETS = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")
ALL_DATASETS = tuple(DATASET2METRIC)
ENGLISH_DATASETS = ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "gov_report",
                    "qmsum", "multi_news", "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en",
                    "lcc", "repobench-p")
E_DATASETS = ("qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec", "triviaqa",
              "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p")
NO_CHAT_TEMPLATE = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")
VARIANTS = ("standard", "e")
BUCKETS = ("0-4k", "4-8k", "8k+")


def score_sample(dataset: str, prediction: str, answers: list[str], all_classes=None) -> float:
    """The official per-sample LongBench score in [0, 1] (eval.py ``scorer``), first-line rule included."""
    if dataset not in DATASET2METRIC:
        raise unknown_name("LongBench dataset", dataset, DATASET2METRIC)
    if dataset in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = DATASET2METRIC[dataset]
    score = 0.0
    for answer in answers:
        score = max(score, metric(prediction, answer, all_classes=all_classes))
    return score


def length_bucket(length: int) -> str:
    """eval.py ``scorer_e`` buckets of the record's ``length`` field (words, or characters for Chinese)."""
    return "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"


def middle_truncate(text: str, lm, max_length: int) -> tuple[str, bool]:
    """pred.py: tokens of ``text`` (with special tokens) over ``max_length`` keep the first and last
    ``int(max_length / 2)``, decoded separately with special tokens skipped and concatenated."""
    ids = lm.encode(text)
    if len(ids) <= max_length:
        return text, False
    half = int(max_length / 2)
    return lm.decode(ids[:half]) + lm.decode(ids[-half:]), True


@dataclass
class LongBench(Task):
    """datasets: LongBench dataset names; variant: standard | e (LongBench-E, length buckets);
    mode: official | query_agnostic; source: hub | local | sample; data_dir: folder of <dataset>.jsonl files;
    revision: hub revision; max_length: middle-truncation length (null = model.longbench_max_length);
    samples_per_dataset: keep only the first N samples of each dataset (null = all);
    max_new_tokens: override of dataset2maxlen, for smoke tests (null = official)."""

    name: ClassVar[str] = "longbench"
    datasets: list[str] = field(default_factory=lambda: list(ENGLISH_DATASETS))
    variant: str = "standard"
    mode: str = "official"
    source: str = "sample"
    data_dir: str | None = None
    revision: str | None = None
    max_length: int | None = None
    samples_per_dataset: int | None = None
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise unknown_name("longbench.variant", self.variant, VARIANTS)
        if self.mode not in MODES:
            raise unknown_name("longbench.mode", self.mode, MODES)
        check_source(self.source, self.data_dir)
        accepted = E_DATASETS if self.variant == "e" else ALL_DATASETS
        for dataset in self.datasets:
            if dataset not in accepted:
                raise unknown_name(f"LongBench{'-E' if self.variant == 'e' else ''} dataset", dataset, accepted)
        if not self.datasets:
            raise ConfigError(f"longbench.datasets is empty; accepted: {', '.join(accepted)}")
        if self.max_length is not None and self.max_length < 2:
            raise ConfigError(f"longbench.max_length={self.max_length} must be >= 2 tokens")
        for key in ("samples_per_dataset", "max_new_tokens"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"longbench.{key}={value} must be >= 1 (or null)")

    def samples(self) -> list[Sample]:
        out = []
        for dataset in self.datasets:
            config = f"{dataset}_e" if self.variant == "e" else dataset
            files = tuple(f"{prefix}{config}.{ext}" for prefix in ("", "data/") for ext in ("jsonl", "parquet", "json"))
            ref = DataRef(HUB_ID, config, "test", files, hub_file="data.zip", member=f"data/{config}.jsonl")
            records, provenance = load_records(ref, self.source, self.data_dir, self.revision, SAMPLE_DIR)
            for record in records[: self.samples_per_dataset]:
                out.append(self._sample(dataset, record, provenance))
        return out

    def _sample(self, dataset: str, record: dict, provenance: dict) -> Sample:
        classes = record.get("all_classes")
        return Sample(
            id=str(record["_id"]), context=record["context"], question=record["input"],
            references=[str(a) for a in record["answers"]],
            meta={"dataset": dataset, "all_classes": None if classes is None else [str(c) for c in classes],
                  "length": int(record["length"]), "language": record.get("language") or "", "mode": self.mode,
                  "variant": self.variant, **provenance},
        )

    def build_prompt(self, sample: Sample, lm) -> Prompt:
        dataset = sample.meta["dataset"]
        template = DATASET2PROMPT[dataset]
        max_length = self.max_length or lm.longbench_max_length
        templated = dataset not in NO_CHAT_TEMPLATE
        if self.mode == "official":
            raw = template.format(context=sample.context, input=sample.question)
            text, truncated = middle_truncate(raw, lm, max_length)
            ids = lm.encode_prompt(lm.chat(text) if templated else text, templated=templated)
            suffix = None
        else:
            cut = template.index("{context}") + len("{context}")
            head = template[:cut].format(context=sample.context)
            tail = template[cut:].format(input=sample.question)
            room = max_length - len(lm.encode(tail, add_special_tokens=False))
            if room < 2:
                raise ConfigError(f"sample '{sample.id}': the question alone exceeds max_length={max_length}")
            head, truncated = middle_truncate(head, lm, room)
            ids, suffix = encode_parts(lm, head, tail, templated)
        stops, min_new = set(), 0
        if dataset == "samsum":  # pred.py: eos_token_id=[eos, id("\n")], min_length=context_length+1
            stops, min_new = {lm.encode("\n", add_special_tokens=False)[-1]}, 1
        return Prompt(context_ids=ids, max_new_tokens=self.max_new_tokens or DATASET2MAXLEN[dataset],
                      suffix_ids=suffix, stop_token_ids=stops, min_new_tokens=min_new, truncated=truncated)

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        meta = sample.meta
        return {"score": score_sample(meta["dataset"], prediction, sample.references, meta.get("all_classes"))}

    def aggregate(self, predictions: pd.DataFrame) -> list[dict]:
        """Dataset rows (and LongBench-E bucket rows), then category and overall averages of dataset scores."""
        rows = []
        present = set(predictions["dataset"])
        for dataset in (d for d in self.datasets if d in present):
            group = predictions[predictions["dataset"] == dataset]
            scores = group["metric.score"].astype(float).tolist()
            rows.append(self._row(dataset, _percent(scores), len(scores), "all"))
            if self.variant == "e":
                buckets = [length_bucket(int(n)) for n in group["meta.length"]]
                for bucket in BUCKETS:
                    in_bucket = [s for s, b in zip(scores, buckets) if b == bucket]
                    if in_bucket:
                        rows.append(self._row(dataset, _percent(in_bucket), len(in_bucket), bucket))
        return rows + self._averages(rows)

    def _row(self, dataset: str, value: float, n: int, bucket: str, category: str | None = None,
             scorer: str = "mean_of_datasets") -> dict:
        return {"dataset": dataset, "metric": "score", "value": value, "n": n, "length_bucket": bucket,
                "category": category or CATEGORY_OF[dataset], "mode": self.mode,
                "scorer": DATASET2METRIC[dataset].__name__ if category is None else scorer}

    def _averages(self, dataset_rows: list[dict]) -> list[dict]:
        out = []
        for bucket in ("all", *BUCKETS):
            rows = [r for r in dataset_rows if r["length_bucket"] == bucket]
            groups = {c: [r for r in rows if r["category"] == c] for c in CATEGORIES}
            groups["overall"] = rows
            for category, members in groups.items():
                if members:
                    value = round(sum(r["value"] for r in members) / len(members), 2)
                    out.append(self._row(f"avg:{category}", value, sum(r["n"] for r in members), bucket, category))
            for language in ("en", "zh"):
                members = [r for r in rows if language_of(r["dataset"]) == language]
                if members:
                    value = round(leaderboard_average({r["dataset"]: r["value"] for r in members}), 2)
                    out.append(self._row(f"avg:leaderboard_{language}", value, sum(r["n"] for r in members), bucket,
                                         f"leaderboard_{language}", "mean_of_category_means"))
        return out


def language_of(dataset: str) -> str:
    return "zh" if dataset in CHINESE_DATASETS else "en"


def leaderboard_average(scores: dict[str, float]) -> float:
    """The official leaderboard's Avg of one language's dataset scores: the mean of its category means."""
    by_category: dict[str, list[float]] = {}
    for dataset, score in scores.items():
        by_category.setdefault(CATEGORY_OF[dataset], []).append(score)
    return sum(sum(v) / len(v) for v in by_category.values()) / len(by_category)


def _percent(scores: list[float]) -> float:
    return round(100 * sum(scores) / len(scores), 2)
