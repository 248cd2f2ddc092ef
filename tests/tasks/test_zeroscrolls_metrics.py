"""ZeroSCROLLS metrics against values computed by hand."""

from __future__ import annotations

import pytest

from kvbench.tasks import zeroscrolls_metrics as zm


def test_f1_uses_squad_normalization_and_unidecode():
    assert zm.f1_score("Café Müller.", "the cafe muller") == 1.0  # accents folded, article and '.' dropped
    # [sst2, and, ag, news] vs [sst2, ag, news]: P = 3/4, R = 1 -> 6/7
    assert zm.f1_score("SST-2 and AG News", "SST-2, AG News") == pytest.approx(6 / 7)
    assert zm.max_over_references(zm.f1_score, "Gull", ["boat", "The Gull"]) == 1.0


def test_accuracy_compares_the_first_standalone_letter():
    assert zm.accuracy_score("The answer is (B) Benn", "(B) Benn") == 1.0  # 'The' and 'answer' are not letters
    assert zm.accuracy_score("Answer: C", "(B) Benn") == 0.0
    assert zm.accuracy_score("A: or maybe B", "(B) Benn") == 0.0  # the first standalone letter is A
    assert zm.accuracy_score("no letter here", "(A) x") == 0.0


def test_exponential_similarity_of_percentages():
    assert zm.exp_similarity_score("About 40% of them", "50%") == 0.5  # 0.5 ** (10 / 10)
    assert zm.exp_similarity_score("45.5%", "50%") == pytest.approx(0.7320428)  # 0.5 ** 0.45
    assert zm.exp_similarity_score("50%", "50%") == 1.0
    assert zm.exp_similarity_score("half of them", "50%") == 0.0
    assert zm.exp_similarity_score("10%", "no percentage") == 0.5  # reference without % counts as 0%


def test_concordance_index_as_lifelines_defines_it():
    # 6 pairs, only (1, 2) swapped -> 5/6
    assert zm.concordance_index([1, 2, 3, 4], [2, 1, 3, 4]) == pytest.approx(5 / 6)
    # tied scores count 1/2: pairs (0,1) tie, (0,2) and (1,2) concordant -> 2.5 / 3
    assert zm.concordance_index([1, 2, 3], [1, 1, 2]) == pytest.approx(2.5 / 3)
    assert zm.concordance_index([1, 2, 3], [3, 2, 1]) == 0.0
    # equal times are not comparable: only (0,2) discordant and (1,2) concordant remain -> 1/2
    assert zm.concordance_index([1, 1, 2], [3, 1, 2]) == 0.5
    with pytest.raises(ZeroDivisionError):
        zm.concordance_index([1, 1], [1, 2])


def test_book_sum_sort_score_compares_positions_of_each_summary():
    assert zm.concordance_index_score("Order: 2,3,1.", "2, 3, 1") == 1.0
    # gold ids [2,3,1] -> positions of ids 1..3 = [3,1,2]; pred [3,2,1] -> [3,2,1]:
    # (id1,id2) concordant, (id1,id3) concordant, (id2,id3) discordant -> 2/3
    assert zm.concordance_index_score("3, 2, 1", "2, 3, 1") == pytest.approx(2 / 3)
    assert zm.concordance_index_score("2, 3", "2, 3, 1") == 0.0  # not the same ids
    assert zm.concordance_index_score("2, 2, 1", "2, 3, 1") == 0.0


def test_rouge_1_2_l_with_stemming():
    scores = zm.rouge_scores("the cat sat on the mat", ["the cat is on the mat"])
    # unigrams: 5 of 6 shared -> 5/6; bigrams: the-cat, on-the, the-mat of 5 -> 3/5; LCS 'the cat on the mat' -> 5/6
    assert scores == pytest.approx({"rouge1": 5 / 6, "rouge2": 0.6, "rougeL": 5 / 6})
    assert zm.rouge_scores("The cats sat", ["a dog", "the cat sat"]) == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}
