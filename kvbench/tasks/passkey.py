"""Passkey retrieval (Mohtashami & Jaggi 2023, as in longctx_bench): a random number hidden in filler text.

Prompt: instruction, filler with the needle at ``depth`` percent, then ``What is the pass key?`` and the
answer prefix ``The pass key is``, which the model continues. With a chat format the answer prefix opens
the assistant turn (after the template), the chat equivalent of the raw-text completion; inside the user
turn, SmolLM2-135M-Instruct re-states it and runs out of its 10 tokens (exact match 2/6 vs 6/6 at 512-1k).

``mode=query_agnostic``: instruction and filler (with the needle) are prefilled and compressed alone; the
question (and the chat template's tail and the answer prefix) is fed afterwards.

Scoring: ``exact_match`` = the passkey digits appear in the prediction; ``partial_match`` = longest common
substring of passkey and prediction / passkey length (the longctx_bench partial score).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import ClassVar

from kvbench.errors import ConfigError, unknown_name
from kvbench.tasks.base import MODES, Prompt, Sample, Task, encode_parts

INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key?"
ANSWER_PREFIX = "The pass key is"


@dataclass
class Passkey(Task):
    """context_lengths: prompt token targets; depths: needle depth in percent; samples_per_cell: keys per cell."""

    name: ClassVar[str] = "passkey"
    context_lengths: list[int] = field(default_factory=lambda: [512, 1024])
    depths: list[float] = field(default_factory=lambda: [0, 50, 100])
    samples_per_cell: int = 1
    key_digits: int = 5
    max_new_tokens: int = 10
    seed: int = 42
    mode: str = "official"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise unknown_name("passkey.mode", self.mode, MODES)
        if not self.context_lengths or min(self.context_lengths) < 64:
            raise ConfigError(f"passkey.context_lengths={list(self.context_lengths)}: each must be >= 64 tokens")
        bad = [d for d in self.depths if not 0 <= d <= 100]
        if bad:
            raise ConfigError(f"passkey.depths {bad} outside [0, 100]")

    def samples(self) -> list[Sample]:
        rng = random.Random(self.seed)
        out = []
        for length in self.context_lengths:
            for depth in self.depths:
                for i in range(self.samples_per_cell):
                    key = str(rng.randrange(10 ** (self.key_digits - 1), 10**self.key_digits))
                    out.append(Sample(
                        id=f"passkey-{length}-{depth:g}-{i}", context="", question=QUESTION,
                        answer_prefix=ANSWER_PREFIX, references=[key],
                        meta={"dataset": "passkey", "context_length": length, "depth": depth, "key": key,
                              "mode": self.mode},
                    ))
        return out

    def build_prompt(self, sample: Sample, lm) -> Prompt:
        key, length, depth = sample.meta["key"], sample.meta["context_length"], sample.meta["depth"]
        needle = NEEDLE.format(key=key)
        # measured as the final prompt is encoded (a BOS added for format-string chat formats counts too)
        fixed = sum(len(ids or []) for ids in self._encode(lm, f"{INSTRUCTION}\n{needle}"))
        per_filler = max(1, len(lm.encode(FILLER * 8, add_special_tokens=False)) / 8)
        n_filler = max(0, int((length - fixed) / per_filler))  # no filler if the target is below `fixed`
        before = round(n_filler * depth / 100)
        text = f"{INSTRUCTION}\n{FILLER * before}{needle}{FILLER * (n_filler - before)}"
        ids, suffix = self._encode(lm, text)
        return Prompt(context_ids=ids, suffix_ids=suffix, max_new_tokens=self.max_new_tokens)

    def _encode(self, lm, text: str) -> tuple[list[int], list[int] | None]:
        """(prefilled ids, ids fed after prefill compression or None). Question in the user turn; the answer
        prefix after the chat template, so the model continues it."""
        templated = lm.chat_format is not None
        if self.mode == "query_agnostic":
            ids, suffix = encode_parts(lm, text, f"\n{QUESTION}" + ("" if templated else f" {ANSWER_PREFIX}"),
                                       templated)
            return ids, suffix + (lm.encode(ANSWER_PREFIX, add_special_tokens=False) if templated else [])
        if not templated:
            return lm.encode_prompt(f"{text}\n{QUESTION} {ANSWER_PREFIX}", templated=False), None
        return lm.encode_prompt(lm.chat(f"{text}\n{QUESTION}") + ANSWER_PREFIX, templated=True), None

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        key = sample.meta["key"]
        match = SequenceMatcher(None, key, prediction).find_longest_match(0, len(key), 0, len(prediction))
        return {"exact_match": float(key in prediction), "partial_match": match.size / len(key)}
