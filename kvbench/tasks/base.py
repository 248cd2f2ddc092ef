"""The task interface: samples in, prompts out, predictions scored. A task knows nothing about methods.

A generation task implements ``samples``, ``build_prompt`` and ``score`` (and ``aggregate`` if its dataset
score is not the mean of per-sample values). Tasks that are not greedy generation (perplexity) override
``predict``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import pandas as pd

from kvbench.errors import ConfigError

if TYPE_CHECKING:
    from kvbench.engine import Engine
    from kvbench.models import LanguageModel


@dataclass
class Sample:
    """One benchmark item. ``context`` is what query-agnostic compression sees alone; ``question`` and
    ``answer_prefix`` follow it. ``meta`` carries dataset-specific fields (dataset, length, depth, all_classes)."""

    id: str
    context: str
    question: str = ""
    answer_prefix: str = ""
    references: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)


@dataclass
class Prompt:
    """Token ids for the engine. ``suffix_ids`` is fed after prefill compression (query-agnostic mode)."""

    context_ids: list[int]
    max_new_tokens: int
    suffix_ids: list[int] | None = None
    stop_token_ids: set[int] = field(default_factory=set)
    stop_strings: list[str] = field(default_factory=list)  # generation stops once the output contains one
    min_new_tokens: int = 0
    truncated: bool = False


# Query modes. official: the task's own prompt, prefilled (and compressed) whole. query_agnostic: the
# context is prefilled and compressed alone, the question (and what follows it) is fed afterwards
# (Prompt.suffix_ids), so methods that look at the last prompt tokens cannot see the question.
MODES = ("official", "query_agnostic")
NO_QUERY = "no_query"  # the mode recorded by tasks without a question (perplexity, efficiency)
# Where the question part starts in the chat-templated text (query_agnostic); never part of benchmark text.
SPLIT_MARKER = "\u0000kvbench-question\u0000"


def encode_parts(lm: "LanguageModel", head: str, tail: str, templated: bool) -> tuple[list[int], list[int]]:
    """Token ids of ``head`` (prefilled, compressed) and ``tail`` (fed after compression) such that together
    they are the prompt ``head + tail`` (chat-templated if ``templated``), tokenized as two pieces."""
    if not templated:
        return lm.encode_prompt(head, templated=False), lm.encode(tail, add_special_tokens=False)
    before, found, after = lm.chat(head + SPLIT_MARKER + tail).partition(SPLIT_MARKER)
    if not found:
        raise ConfigError(f"model '{lm.name}': its chat template altered the prompt; use task.mode=official")
    return lm.encode_prompt(before, templated=True), lm.encode(after, add_special_tokens=False)


@dataclass
class GenerationCall:
    """Samples of a batch that decode with the same settings: one ``Engine.generate`` call (``indices`` into
    the batch; ``contexts`` and ``suffixes`` theirs, in that order)."""

    indices: list[int]
    contexts: list[list[int]]
    suffixes: list[list[int]] | None
    max_new_tokens: int
    stop_token_ids: set[int]
    min_new_tokens: int
    stop_when: Callable[[list[int]], bool] | None

    def generate(self, engine: "Engine") -> list:
        return engine.generate(self.contexts, max_new_tokens=self.max_new_tokens, stop_token_ids=self.stop_token_ids,
                               suffixes=self.suffixes, min_new_tokens=self.min_new_tokens, stop_when=self.stop_when)


def generation_calls(prompts: list[Prompt], lm: "LanguageModel") -> list[GenerationCall]:
    """The engine calls of a batch's prompts: one per identical decoding setup."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(prompts):
        key = (p.max_new_tokens, frozenset(p.stop_token_ids), tuple(p.stop_strings), p.min_new_tokens,
               p.suffix_ids is None)
        groups.setdefault(key, []).append(i)
    return [GenerationCall(indices=idx, contexts=[prompts[i].context_ids for i in idx],
                           suffixes=None if no_suffix else [prompts[i].suffix_ids for i in idx],
                           max_new_tokens=max_new, stop_token_ids=set(stops) | lm.eos_token_ids,
                           min_new_tokens=min_new, stop_when=stop_string_check(lm, stop_strings))
            for (max_new, stops, stop_strings, min_new, no_suffix), idx in groups.items()]


class Task:
    """Base class. Subclasses are configured by Hydra (``conf/task/<name>.yaml``).

    shares_prompt_pass: the task generates through ``generation_calls`` and ``result_rows`` (``predict``'s
    default), so the points of a sweep may share each sample's prompt pass (``kvbench.sweep``). A task that
    overrides ``predict`` runs its own engine passes: it sets False."""

    name: ClassVar[str] = "base"
    shares_prompt_pass: ClassVar[bool] = True
    # True: ``predict`` runs its samples as one batch in lockstep, so the runner hands it ``batch_size`` samples
    # at a time (and batch_size=auto is refused); False: every sample at once, the engine batching them.
    lockstep_batches: ClassVar[bool] = False

    def samples(self) -> list[Sample]:
        raise NotImplementedError

    def build_prompt(self, sample: Sample, lm: "LanguageModel") -> Prompt:
        raise NotImplementedError

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        """Per-sample metric values (fractions in [0, 1] unless the metric says otherwise)."""
        raise NotImplementedError

    def postprocess(self, prediction: str, sample: Sample) -> str:
        """Turn decoded text into the prediction that is stored and scored (default: unchanged)."""
        return prediction

    def check_fits(self, prompt: Prompt, sample: Sample, lm: "LanguageModel", position_mode: str) -> None:
        """A prompt that cannot fit the model's context is an error, never a silent overflow. Tasks that
        stream past the context legitimately (perplexity with pos-shift positions) override this."""
        total = len(prompt.context_ids) + len(prompt.suffix_ids or []) + prompt.max_new_tokens
        if total > lm.max_length:
            raise ConfigError(
                f"sample '{sample.id}' needs {total} tokens (prompt + max_new_tokens) but model "
                f"'{lm.name}' has max_length={lm.max_length}; enable the task's truncation or use shorter contexts"
            )

    def dataset_of(self, sample: Sample) -> str:
        return sample.meta.get("dataset", self.name)

    def aggregate(self, predictions: pd.DataFrame) -> list[dict]:
        """Per-run metric rows from per-sample rows: mean x 100 of every ``metric.*`` column per dataset."""
        rows = []
        metric_cols = [c for c in predictions.columns if c.startswith("metric.")]
        for dataset, group in predictions.groupby("dataset", sort=True):
            for col in metric_cols:
                values = group[col].dropna()
                if len(values):
                    rows.append({"dataset": dataset, "metric": col[len("metric."):],
                                 "value": round(100 * float(values.mean()), 2), "n": int(len(values)),
                                 "mode": getattr(self, "mode", NO_QUERY)})
        return rows

    def artifacts(self, predictions: pd.DataFrame) -> dict[str, str]:
        """Extra files published inside the run directory (relative path -> text), e.g. leaderboard
        submissions. Default: none."""
        return {}

    def predict(self, samples: list[Sample], lm: "LanguageModel", engine: "Engine") -> list[dict]:
        """Generate greedily for a batch of samples; one result row per sample."""
        prompts = [self.build_prompt(s, lm) for s in samples]
        calls = generation_calls(prompts, lm)
        return self.result_rows(samples, prompts, calls, [call.generate(engine) for call in calls], lm)

    def result_rows(self, samples: list[Sample], prompts: list[Prompt], calls: list[GenerationCall],
                    generations: list[list], lm: "LanguageModel") -> list[dict]:
        """The scored row of every sample of a batch from its calls' ``Generation``s (one list per call)."""
        rows: list[dict | None] = [None] * len(samples)
        for call, gens in zip(calls, generations):
            for i, gen in zip(call.indices, gens):
                sample = samples[i]
                text = self.postprocess(lm.decode(gen.tokens), sample)
                row = {
                    "sample_id": sample.id,
                    "dataset": self.dataset_of(sample),
                    "prompt_length": gen.prompt_length + len(prompts[i].suffix_ids or []),
                    "truncated": prompts[i].truncated,
                    "prediction": text,
                    "references": list(sample.references),
                    "output_tokens": len(gen.tokens),
                    "mode": getattr(self, "mode", NO_QUERY),
                    **generation_measurements(gen),
                    **{f"meta.{k}": v for k, v in sample.meta.items() if isinstance(v, (int, float, str))},
                }
                row.update({f"metric.{k}": v for k, v in self.score(text, sample).items()})
                rows[i] = row
        return rows


def stop_string_check(lm: "LanguageModel", stop_strings: tuple[str, ...]):
    """A per-row check for the engine: True once the decoded output ends with text containing a stop string.
    Only the tail is decoded (enough tokens to hold the longest stop string), so a step costs O(1)."""
    if not stop_strings:
        return None
    tail = 4 * max(len(s) for s in stop_strings) + 8

    def stopped(tokens: list[int]) -> bool:
        text = lm.decode(tokens[-tail:])
        return any(s in text for s in stop_strings)

    return stopped


def generation_measurements(gen) -> dict:
    """Realized budget and timings of one ``Generation`` as flat result columns."""
    kept = gen.kept_per_layer_head
    flat = [n for layer in kept for n in layer]
    return {
        "n_keep": gen.n_keep,
        "kept_mean": sum(flat) / len(flat),
        "kept_min": min(flat),
        "kept_max": max(flat),
        "kept_per_layer": [sum(layer) / len(layer) for layer in kept],
        "kept_per_layer_head": kept,
        "kv_bytes_full": gen.kv_bytes_full,
        "kv_bytes_compressed": gen.kv_bytes_compressed,
        "kv_bytes_final": gen.kv_bytes_final,
        "prefill_seconds": gen.prefill_seconds,
        "compress_seconds": gen.compress_seconds,
        "decode_seconds": gen.decode_seconds,
        "decode_compress_seconds": gen.decode_compress_seconds,
        "tpot_seconds": gen.tpot_seconds,
        "decode_kv_bytes_mean": gen.decode_kv_bytes_mean,
        "peak_memory_bytes": gen.peak_memory_bytes,
        "peak_memory_above_weights_bytes": gen.peak_memory_above_weights_bytes,
        "stopped_by": gen.stopped_by,
        "decode_batch_size": gen.batch_size,
    }
