"""ZeroSCROLLS per-sample metrics, as the official ZeroSCROLLS metric scripts compute them.

* token F1 (qasper, narrative_qa, musique): SQuAD normalization (lowercase, no ASCII punctuation, no articles,
  collapsed whitespace) followed by ``unidecode``; max over references.
* accuracy (quality): the first standalone capital letter A-D in prediction and in reference must agree.
* exponential similarity (space_digest): ``0.5 ** (|gold% - pred%| / 10)`` of the first ``\\d+\\.?\\d*%``
  in each; no percentage in the prediction -> 0 (none in the reference counts as 0%).
* concordance index (book_sum_sort): Harrell's C of the gold and predicted positions of each summary id,
  as ``lifelines.utils.concordance_index`` defines it; 0 unless the predicted ids are the gold ids.
* ROUGE-1/2/L F-measure (summarization) with ``rouge_score`` and its Porter stemmer; max over references
  per ROUGE type. The task score is the geometric mean of the three task-level means.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from functools import lru_cache

from unidecode import unidecode

PUNCTUATION = set(string.punctuation)
PERCENTAGE = re.compile(r"\d+\.?\d*%")
CHOICE = re.compile(r"\b[A-D]\b")
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


def normalize_f1(s: str) -> str:
    s = "".join(ch for ch in s.lower() if ch not in PUNCTUATION)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return unidecode(" ".join(s.split()))


def f1_score(prediction: str, ground_truth: str) -> float:
    pred, gold = normalize_f1(prediction).split(), normalize_f1(ground_truth).split()
    num_same = sum((Counter(pred) & Counter(gold)).values())
    if num_same == 0:
        return 0.0
    precision, recall = num_same / len(pred), num_same / len(gold)
    return 2 * precision * recall / (precision + recall)


def accuracy_score(prediction: str, ground_truth: str) -> float:
    gold = CHOICE.search(ground_truth)
    if gold is None:
        raise ValueError(f"quality reference without an A-D letter: {ground_truth!r}")
    pred = CHOICE.search(prediction)
    return float(pred is not None and pred.group() == gold.group())


def _percentage(s: str) -> float | None:
    match = PERCENTAGE.search(s)
    return None if match is None else float(match.group().rstrip("%"))


def exp_similarity_score(prediction: str, ground_truth: str) -> float:
    pred = _percentage(prediction)
    if pred is None:
        return 0.0
    gold = _percentage(ground_truth) or 0.0
    return 0.5 ** (abs(gold - pred) / 10)


def concordance_index(event_times: list[float], predicted_scores: list[float]) -> float:
    """Harrell's C with every event observed (lifelines ``concordance_index``): over pairs with different
    times, 1 if the scores are ordered like the times, 0.5 if the scores tie, 0 otherwise; pairs with equal
    times are not comparable. No comparable pair raises ZeroDivisionError, as lifelines does."""
    correct, tied, pairs = 0, 0, 0
    n = len(event_times)
    for i in range(n):
        for j in range(i + 1, n):
            if event_times[i] == event_times[j]:
                continue
            pairs += 1
            if predicted_scores[i] == predicted_scores[j]:
                tied += 1
            elif (event_times[i] < event_times[j]) == (predicted_scores[i] < predicted_scores[j]):
                correct += 1
    if pairs == 0:
        raise ZeroDivisionError("No admissable pairs in the dataset.")
    return (correct + 0.5 * tied) / pairs


def summary_ids(s: str) -> list[int]:
    """The ids in an answer like '3, 1, 2': keep digits, whitespace and commas, split on commas/whitespace."""
    cleaned = re.sub(r"[^0-9\s,]", "", s).replace(",", " ").strip(string.punctuation)
    return [int(token) for token in cleaned.split()]


def _position_of_id(ids: list[int]) -> list[int]:
    """[3, 1, 2] (id at each position) -> [2, 3, 1] (1-based position of id 1, 2, 3)."""
    positions = [-1] * len(ids)
    for position, summary_id in enumerate(ids, 1):
        positions[summary_id - 1] = position
    return positions


def concordance_index_score(prediction: str, ground_truth: str) -> float:
    pred, gold = summary_ids(prediction), summary_ids(ground_truth)
    if sorted(pred) != sorted(gold):
        return 0.0
    return concordance_index(_position_of_id(gold), _position_of_id(pred))


@lru_cache(maxsize=1)
def _rouge_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)


def rouge_scores(prediction: str, references: list[str]) -> dict[str, float]:
    """ROUGE-1/2/L F-measure of the prediction, each the max over references."""
    scores = [_rouge_scorer().score(reference, prediction) for reference in references]
    return {kind: max(s[kind].fmeasure for s in scores) for kind in ROUGE_TYPES}


def max_over_references(metric, prediction: str, references: list[str]) -> float:
    return max(metric(prediction, reference) for reference in references)
