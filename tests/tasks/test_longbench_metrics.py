"""LongBench metrics against values computed by hand (each comment shows the arithmetic)."""

from __future__ import annotations

import pytest

from kvbench.tasks import longbench_metrics as m
from kvbench.tasks.longbench import score_sample


def test_qa_f1_normalizes_case_punctuation_and_articles():
    assert m.qa_f1_score("The Gull!", "Gull") == 1.0  # both -> "gull"
    assert m.qa_f1_score("U.S.A.", "USA") == 1.0  # punctuation removed inside words
    # [big, red, boat] vs [red, boat]: P = 2/3, R = 1 -> F1 = 0.8
    assert m.qa_f1_score("a big red boat", "the red boat") == pytest.approx(0.8)
    # [paris, france] vs [paris]: P = 1/2, R = 1 -> 2/3
    assert m.qa_f1_score("Paris, France", "Paris") == pytest.approx(2 / 3)
    assert m.qa_f1_score("", "Paris") == 0.0


def test_qa_f1_zh_uses_jieba_words_and_drops_chinese_punctuation():
    assert m.qa_f1_zh_score("二十四小时。", "二十四小时") == 1.0  # '。' dropped
    # jieba: [北京] vs [北京, 上海] (the space token normalizes to '' and is dropped): P = 1, R = 1/2 -> 2/3
    assert m.qa_f1_zh_score("北京", "北京 上海") == pytest.approx(2 / 3)
    assert m.qa_f1_zh_score("周一", "星期一") == 0.0


def test_rouge_l_is_the_rouge_package_summary_level_f_on_unique_words():
    # unique words: hyp {the, cat, sat, on, mat} (5), ref {the, cat, is, on, mat} (5), union LCS {the, cat, on,
    # mat} (4): P = R = 0.8 -> F = 0.8
    assert m.rouge_score("the cat sat on the mat", "the cat is on the mat") == pytest.approx(0.8, abs=1e-6)
    assert m.rouge_score("", "anything") == 0.0  # 'Hypothesis is empty' -> 0, as the official bare except
    # jieba: [北京, 天气] vs [北京]: P = 1/2, R = 1 -> F = 2/3
    assert m.rouge_zh_score("北京天气", "北京") == pytest.approx(2 / 3, abs=1e-6)


def test_classification_counts_matches_and_keeps_the_official_removal_skip():
    classes = ["Animal", "Color", "Food"]
    assert m.classification_score("Color", "Color", all_classes=classes) == 1.0
    assert m.classification_score("Color or Food", "Color", all_classes=classes) == 0.5  # 2 classes matched
    assert m.classification_score("Animal", "Color", all_classes=classes) == 0.0
    # 'Number' is a substring of the truth and removed: only the truth remains -> 1
    assert m.classification_score("Number of something", "Number of something",
                                  all_classes=["Number", "Number of something", "Date"]) == 1.0
    # matches [Ab, A, Abc]; removing 'Ab' makes the loop skip 'A' (official quirk) -> [A, Abc] -> 1/2
    assert m.classification_score("Abc", "Abc", all_classes=["Ab", "A", "Abc"]) == 0.5


def test_retrieval_and_count_are_fractions_of_numbers_equal_to_the_target():
    assert m.retrieval_score("Paragraph 2", "Paragraph 2") == 1.0
    assert m.retrieval_score("Paragraph 2 or Paragraph 12", "Paragraph 2") == 0.5  # numbers [2, 12]
    assert m.retrieval_score("I do not know", "Paragraph 2") == 0.0
    assert m.retrieval_zh_score("段落2", "段落2") == 1.0
    assert m.retrieval_zh_score("答案是段落12", "段落2") == 0.0
    assert m.count_score("There are 3 unique paragraphs out of 4", "3") == 0.5  # numbers [3, 4]


def test_fuzz_ratio_is_fuzzywuzzys_difflib_ratio_not_rapidfuzzs():
    # difflib: longest block 'ba' (M = 2), T = 6 + 4 -> 40; rapidfuzz (LCS 'ba ' = 3) would give 60
    assert m.fuzz_ratio("bca ba", "bac ") == 40
    assert m.fuzz_ratio("abcd", "abce") == 75  # M = 3 of T = 8 -> 75
    assert m.fuzz_ratio("", "") == 100 and m.fuzz_ratio("", "x") == 0
    assert m.fuzz_ratio("abc", "abd") == 67  # 2 * 2 / 6 = 66.67 -> int(round()) = 67


def test_code_sim_skips_comment_and_fence_lines():
    prediction = "\n# comment\n```python\n    total += distance(a, b)\n"
    # line '    total += distance(a, b)' (27 chars) is a block of the 31-char truth: 2 * 27 / 58 = 0.931 -> 93
    assert m.code_sim_score(prediction, "        total += distance(a, b)") == 0.93
    assert m.code_sim_score("// only a comment", "x = 1") == 0.0  # no usable line -> '' vs truth


def test_score_sample_first_line_rule_and_max_over_answers():
    trec_classes = ["Color", "Number of something", "Date"]
    assert score_sample("trec", "\nColor\nQuestion: Date?", ["Color"], trec_classes) == 1.0  # 'Date' is on line 2
    lsht_classes = ["体育", "财经", "科技"]
    assert score_sample("lsht", "科技\n新闻：体育", ["科技"], lsht_classes) == 1.0
    assert score_sample("triviaqa", "\n\nFour\nPassage: four strings", ["four", "4"]) == 1.0
    # hotpotqa has no first-line rule: [arno, of, kest, something, else] vs [arno, of, kest] -> 2*0.6/1.6 = 0.75
    assert score_sample("hotpotqa", "Arno of Kest\nsomething else", ["Arno of Kest"]) == pytest.approx(0.75)
    # max over answers: 'gull' -> 0, 'fishing boat' -> [boat] vs [fishing, boat] = 2/3
    assert score_sample("narrativeqa", "the boat", ["The Gull", "a fishing boat"]) == pytest.approx(2 / 3)
    assert score_sample("multifieldqa_zh", "二十四小时。", ["二十四小时", "24小时"]) == 1.0
    assert score_sample("passage_retrieval_en", "Paragraph 3, not Paragraph 1", ["Paragraph 3"]) == 0.5
    assert score_sample("lcc", "# next\n        count++;", ["        count++;"]) == 1.0
    # samsum: only the first line is compared; 'tom is coming' vs the same words -> 1
    assert score_sample("samsum", "Tom is coming\nDialogue: x", ["Tom is coming"]) == pytest.approx(1.0, abs=1e-6)


def test_score_sample_rejects_unknown_dataset():
    from kvbench.errors import ConfigError

    with pytest.raises(ConfigError, match="narrativeqa"):
        score_sample("narrative_qa", "x", ["y"])
