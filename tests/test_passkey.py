"""Passkey retrieval: the sample grid, the prompt (needle position, token length) and the two scores."""

from __future__ import annotations

import pytest

from kvbench.errors import ConfigError
from kvbench.tasks.passkey import ANSWER_PREFIX, FILLER, INSTRUCTION, NEEDLE, QUESTION, Passkey



def test_samples_cover_the_grid_with_deterministic_keys():
    task = Passkey(context_lengths=[512, 1024], depths=[0, 100], samples_per_cell=2)
    samples = task.samples()
    assert [s.id for s in samples[:3]] == ["passkey-512-0-0", "passkey-512-0-1", "passkey-512-100-0"]
    assert len(samples) == 8
    keys = [s.meta["key"] for s in samples]
    assert all(len(k) == 5 and k.isdigit() and k[0] != "0" for k in keys)
    assert keys == [s.meta["key"] for s in task.samples()]  # same seed, same keys
    assert keys != [s.meta["key"] for s in Passkey(context_lengths=[512, 1024], depths=[0, 100],
                                                   samples_per_cell=2, seed=7).samples()]
    assert all(s.references == [s.meta["key"]] for s in samples)


@pytest.mark.parametrize("depth, filler_before", [(0, 0), (50, 2), (100, 4)])
def test_prompt_puts_the_needle_at_the_depth_and_fits_the_target(tiny_lm, depth, filler_before):
    """Byte tokenizer: FILLER is 90 tokens; the target leaves room for exactly 4 fillers (+ 10 spare tokens)."""
    task = Passkey(context_lengths=[512], depths=[depth])
    sample = task.samples()[0]
    needle = NEEDLE.format(key=sample.meta["key"])
    unfilled = tiny_lm.chat(f"{INSTRUCTION}\n{needle}\n{QUESTION}") + ANSWER_PREFIX
    fixed = len(unfilled.encode()) - len("<s>") + 1  # "<s>" is one token, every other byte one
    length = fixed + 4 * len(FILLER) + 10
    sample.meta["context_length"] = length
    prompt = task.build_prompt(sample, tiny_lm)
    body = FILLER * filler_before + needle + FILLER * (4 - filler_before)
    expected = tiny_lm.chat(f"{INSTRUCTION}\n{body}\n{QUESTION}") + ANSWER_PREFIX  # prefix opens the answer
    assert tiny_lm.tokenizer.decode(prompt.context_ids) == expected
    assert len(prompt.context_ids) == length - 10
    assert prompt.max_new_tokens == 10


@pytest.mark.parametrize("prediction, exact, partial", [
    ("The pass key is 12345.", 1.0, 1.0),
    ("12345", 1.0, 1.0),
    ("The pass key is 1234", 0.0, 4 / 5),
    ("54321", 0.0, 1 / 5),  # longest common substring: one digit
    ("", 0.0, 0.0),
])
def test_scores_on_hand_computed_examples(prediction, exact, partial):
    task = Passkey()
    sample = task.samples()[0]
    sample.meta["key"] = "12345"
    assert task.score(prediction, sample) == {"exact_match": exact, "partial_match": pytest.approx(partial)}


@pytest.mark.parametrize("kwargs, match", [
    ({"context_lengths": [32]}, r"passkey.context_lengths=\[32\]: each must be >= 64"),
    ({"context_lengths": []}, "each must be >= 64"),
    ({"depths": [-5, 50, 101]}, r"passkey.depths \[-5, 101\] outside \[0, 100\]"),
])
def test_bad_settings_are_rejected(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Passkey(**kwargs)


def test_query_agnostic_feeds_question_template_tail_and_answer_prefix_after(tiny_lm):
    official = Passkey(context_lengths=[512], depths=[50])
    agnostic = Passkey(context_lengths=[512], depths=[50], mode="query_agnostic")
    sample = agnostic.samples()[0]
    whole = official.build_prompt(official.samples()[0], tiny_lm)
    split = agnostic.build_prompt(sample, tiny_lm)
    head, tail = tiny_lm.tokenizer.decode(split.context_ids), tiny_lm.tokenizer.decode(split.suffix_ids)
    assert QUESTION not in head and NEEDLE.format(key=sample.meta["key"]) in head
    assert tail.startswith(f"\n{QUESTION}") and tail.endswith(ANSWER_PREFIX)
    assert head + tail == tiny_lm.tokenizer.decode(whole.context_ids)
    with pytest.raises(ConfigError, match="official, query_agnostic"):
        Passkey(mode="agnostic")
