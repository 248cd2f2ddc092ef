"""ZeroSCROLLS (Shaham et al. 2023): 10 long-text tasks, each record a fully formatted ``input``.

Input as the official API runner (experiments/api) builds it: the record's ``input`` as is; if it does not
fit ``max_input_length`` tokens (default ``model.max_length - max_new_tokens``), the start of the input
(instruction + document) is kept up to the room left by ``truncation_seperator + input[query_start_index:]``
and one spare token (``get_max_document_tokens``' ``- 1``), and the separator, query and answer prefix are
appended. ``chat_template=true`` follows the official chat runner (ChatGPT / GPT-4 in openai_api.py): for
non-summarization tasks ``" Do not provide any explanation."`` is appended to the instruction (before the
first blank line), the input is cut at ``query_end_index`` (no answer prefix: the assistant turn starts
instead), it is wrapped in the model's chat format, and the chat format's own tokens are reserved out of
the input's room (the official runner reserves 9 for OpenAI's). ``mode=query_agnostic`` prefills (and
compresses) the part before the query alone and feeds the separator/query/answer prefix afterwards.

Validation is scored locally (see ``zeroscrolls_metrics``); test answers are private, so predictions of
every split are also written in the leaderboard's format, one ``<task>.json`` of ``{id: prediction}`` per
task (the input of the official ``prepare_submission.py``), into the run's directory, in a
``zeroscrolls_<split>`` folder (``artifacts``). ``python -m kvbench.tasks.zeroscrolls RUN_DIR`` writes them
again from a finished run's ``predictions.parquet``.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pandas as pd

from kvbench.errors import ConfigError, unknown_name
from kvbench.tasks import zeroscrolls_metrics as zm
from kvbench.tasks.base import MODES, Prompt, Sample, Task, encode_parts
from kvbench.tasks.sources import PACKAGE_DATA, DataRef, check_source, load_records

HUB_ID = "tau/zero_scrolls"
SAMPLE_DIR = PACKAGE_DATA / "zeroscrolls" / "sample"
SPLITS = ("validation", "test")
# experiments/api/api.py dataset_to_leave_tokens_for_generations
MAX_NEW_TOKENS = {"gov_report": 1024, "summ_screen_fd": 512, "qmsum": 512, "squality": 512, "qasper": 128,
                  "narrative_qa": 64, "quality": 10, "musique": 32, "space_digest": 36, "book_sum_sort": 256}
TASKS = tuple(MAX_NEW_TOKENS)
SUMMARIZATION = ("gov_report", "summ_screen_fd", "qmsum", "squality")  # APIRunner.summarization_datasets
FORMAT_REQUEST = "Do not provide any explanation."  # the chat runner's addition for the other tasks
SCALAR_METRICS = {"qasper": ("f1", zm.f1_score), "narrative_qa": ("f1", zm.f1_score),
                  "musique": ("f1", zm.f1_score), "quality": ("accuracy", zm.accuracy_score),
                  "space_digest": ("exp_similarity", zm.exp_similarity_score),
                  "book_sum_sort": ("concordance_index", zm.concordance_index_score)}
PRIMARY_METRIC = {**{t: name for t, (name, _) in SCALAR_METRICS.items()},
                  **{t: "rouge_geometric_mean" for t in TASKS if t not in SCALAR_METRICS}}


@dataclass
class ZeroScrolls(Task):
    """tasks: ZeroSCROLLS task names; split: validation (scored) | test (predictions only);
    mode: official | query_agnostic; source: hub | local | sample; data_dir: folder with <task>/<split>.jsonl;
    chat_template: wrap the input in the model's chat format; max_input_length: input token limit
    (null = model.max_length - max new tokens); samples_per_task: first N examples per task (null = all);
    max_new_tokens: override of the official generation lengths, for smoke tests (null = official)."""

    name: ClassVar[str] = "zeroscrolls"
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    split: str = "validation"
    mode: str = "official"
    source: str = "sample"
    data_dir: str | None = None
    revision: str | None = None
    chat_template: bool = False
    max_input_length: int | None = None
    samples_per_task: int | None = None
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        for task in self.tasks:
            if task not in TASKS:
                raise unknown_name("ZeroSCROLLS task", task, TASKS)
        if not self.tasks:
            raise ConfigError(f"zeroscrolls.tasks is empty; accepted: {', '.join(TASKS)}")
        if self.split not in SPLITS:
            raise unknown_name("zeroscrolls.split", self.split, SPLITS)
        if self.mode not in MODES:
            raise unknown_name("zeroscrolls.mode", self.mode, MODES)
        check_source(self.source, self.data_dir)
        for key in ("samples_per_task", "max_input_length", "max_new_tokens"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"zeroscrolls.{key}={value} must be >= 1 (or null)")

    def samples(self) -> list[Sample]:
        out = []
        for task in self.tasks:
            files = tuple(f"{task}/{self.split}.{ext}" for ext in ("jsonl", "parquet", "json")) + tuple(
                f"{task}_{self.split}.{ext}" for ext in ("jsonl", "parquet", "json"))
            ref = DataRef(HUB_ID, task, self.split, files, hub_file=f"{task}.zip",
                          member=f"{task}/{self.split}.jsonl")
            records, provenance = load_records(ref, self.source, self.data_dir, self.revision, SAMPLE_DIR)
            by_id: dict[str, list[dict]] = {}
            for record in records:  # one row per (input, reference) pair: a multi-reference example repeats
                by_id.setdefault(str(record["id"]), []).append(record)
            for example_id, rows in list(by_id.items())[: self.samples_per_task]:
                out.append(self._sample(task, example_id, rows, provenance))
        return out

    def _sample(self, task: str, example_id: str, rows: list[dict], provenance: dict) -> Sample:
        first = rows[0]
        text, query_start, query_end = first["input"], int(first["query_start_index"]), int(first["query_end_index"])
        return Sample(
            id=example_id, context=text[:query_start], question=text[query_start:query_end],
            answer_prefix=text[query_end:],
            references=[str(r["output"]) for r in rows if r.get("output")],
            meta={"dataset": task, "split": self.split, "mode": self.mode,
                  "truncation_separator": first["truncation_seperator"], **provenance},
        )

    def build_prompt(self, sample: Sample, lm) -> Prompt:
        task = sample.meta["dataset"]
        max_new = self.max_new_tokens or MAX_NEW_TOKENS[task]
        room = self.max_input_length or lm.max_length - max_new
        head, tail = sample.context, sample.question + sample.answer_prefix
        if self.chat_template:  # the official chat runner; the template's own tokens come out of the room
            head = head if task in SUMMARIZATION else with_format_request(head)
            tail = sample.question
            room -= len(lm.encode_prompt(lm.chat(""), templated=True)) - len(lm.encode(""))
        head_ids = lm.encode(head)
        tail_ids = lm.encode(tail, add_special_tokens=False)
        truncated = len(lm.encode(head + tail)) > room
        if truncated:
            tail = sample.meta["truncation_separator"] + tail
            tail_ids = lm.encode(tail, add_special_tokens=False)
            keep = room - len(tail_ids) - 1  # the official runner leaves one token spare
            if keep < 1:
                raise ConfigError(f"sample '{sample.id}': the query alone exceeds the input limit of {room} tokens")
            head_ids = head_ids[:keep]
            head = lm.decode(head_ids)
        if self.mode == "official" and not self.chat_template:
            ids = head_ids + tail_ids if truncated else lm.encode(head + tail)
            return Prompt(context_ids=ids, max_new_tokens=max_new, truncated=truncated)
        if self.mode == "official":
            ids = lm.encode_prompt(lm.chat(head + tail), templated=True)
            return Prompt(context_ids=ids, max_new_tokens=max_new, truncated=truncated)
        ids, suffix = encode_parts(lm, head, tail, self.chat_template)
        return Prompt(context_ids=ids, max_new_tokens=max_new, suffix_ids=suffix, truncated=truncated)

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        if not sample.references:  # test split: answers are private
            return {}
        task = sample.meta["dataset"]
        if task in SCALAR_METRICS:
            metric_name, metric = SCALAR_METRICS[task]
            return {metric_name: zm.max_over_references(metric, prediction, sample.references)}
        return zm.rouge_scores(prediction, sample.references)

    def aggregate(self, predictions: pd.DataFrame) -> list[dict]:
        """Per task: its metric x 100 (summarization: ROUGE-1/2/L and their geometric mean); then the mean
        of the task scores as ``avg:zeroscrolls``."""
        rows, primary = [], []  # primary: (task score, n) per task
        for task in (t for t in self.tasks if t in set(predictions["dataset"])):
            group = predictions[predictions["dataset"] == task]
            means = {m: 100 * float(group[f"metric.{m}"].mean()) for m in _metric_names(task)
                     if f"metric.{m}" in group and group[f"metric.{m}"].notna().any()}
            if not means:
                continue
            if task not in SCALAR_METRICS:
                means["rouge_geometric_mean"] = math.prod(means.values()) ** (1 / len(means))
            n = int(group[f"metric.{_metric_names(task)[0]}"].notna().sum())
            rows += [self._row(task, m, v, n) for m, v in means.items()]
            primary.append((means[PRIMARY_METRIC[task]], n))
        if primary:
            mean = sum(v for v, _ in primary) / len(primary)
            rows.append(self._row("avg:zeroscrolls", "score", mean, sum(n for _, n in primary)))
        return rows

    def _row(self, dataset: str, metric: str, value: float, n: int) -> dict:
        return {"dataset": dataset, "metric": metric, "value": round(value, 2), "n": n, "split": self.split,
                "mode": self.mode}

    def artifacts(self, predictions: pd.DataFrame) -> dict[str, str]:
        """The leaderboard submission files, published inside the run directory."""
        return {f"zeroscrolls_{self.split}/{task}.json": text for task, text in submission_files(predictions).items()}


def with_format_request(text: str) -> str:
    """The chat runner's ``insert_format_request``: the format request appended to the instruction, i.e.
    the text before the first blank line."""
    end = text.find("\n\n")
    return f"{text[:end].strip()} {FORMAT_REQUEST}{text[end:]}"


def _metric_names(task: str) -> tuple[str, ...]:
    return (SCALAR_METRICS[task][0],) if task in SCALAR_METRICS else zm.ROUGE_TYPES


def submission_files(predictions: pd.DataFrame) -> dict[str, str]:
    """task -> JSON text of ``{id: prediction}`` (prepare_submission.py's input files)."""
    out = {}
    for task, group in predictions.groupby("dataset", sort=True):
        answers = dict(zip(group["sample_id"].astype(str), group["prediction"].astype(str)))
        out[task] = json.dumps(answers, ensure_ascii=False, indent=1)
    return out


def write_submission(predictions: pd.DataFrame, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for task, text in submission_files(predictions).items():
        path = folder / f"{task}.json"
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def main(argv: list[str]) -> None:
    """``python -m kvbench.tasks.zeroscrolls RUN_DIR``: submission files from a finished run."""
    if len(argv) != 1:
        sys.exit("usage: python -m kvbench.tasks.zeroscrolls RUN_DIR (a kvbench run with predictions.parquet)")
    run_dir = Path(argv[0])
    predictions = pd.read_parquet(run_dir / "predictions.parquet")
    for split, group in predictions.groupby("meta.split"):
        for path in write_submission(group, run_dir / f"zeroscrolls_{split}"):
            print(path)


if __name__ == "__main__":
    main(sys.argv[1:])
