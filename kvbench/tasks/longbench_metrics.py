"""LongBench per-sample metrics, computed exactly as THUDM/LongBench ``metrics.py`` + ``eval.py`` compute them.

Every function takes ``(prediction, ground_truth, all_classes=None)`` and returns a float in [0, 1].
Known quirks of the official code are reproduced on purpose (they change reported numbers):
* ``classification_score`` removes items from the list it iterates over, so the element after a removed
  one is never checked;
* ``code_sim_score`` uses fuzzywuzzy's ``fuzz.ratio``, which without python-Levenshtein (the official
  environment) is difflib's Ratcliff-Obershelp ratio rounded to an integer percentage. rapidfuzz's ratio is
  an LCS (Indel) ratio and differs on many strings (e.g. 'bca ba' vs 'bac ': 40 vs 60), so it is not used.
"""

from __future__ import annotations

import logging
import re
import string
from collections import Counter
from difflib import SequenceMatcher

import jieba
from rouge import Rouge

jieba.setLogLevel(logging.WARNING)  # its dictionary-loading chatter otherwise floods every run's log

# Official Chinese punctuation set, verbatim (it has '》' but not '《').
CN_PUNCTUATION = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
EN_PUNCTUATION = set(string.punctuation)
ALL_PUNCTUATION = set(string.punctuation + CN_PUNCTUATION)

# eval.py: these few-shot datasets are scored on the first line of the prediction only.
FIRST_LINE_DATASETS = ("trec", "triviaqa", "samsum", "lsht")


def normalize_answer(s: str) -> str:
    """Lowercase, drop ASCII punctuation, drop the articles a/an/the, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in EN_PUNCTUATION)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def normalize_zh_answer(s: str) -> str:
    """Lowercase, drop ASCII + Chinese punctuation, remove all whitespace."""
    return "".join("".join(ch for ch in s.lower() if ch not in ALL_PUNCTUATION).split())


def token_f1(prediction: list[str], ground_truth: list[str]) -> float:
    common = Counter(prediction) & Counter(ground_truth)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction)
    recall = num_same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, all_classes=None) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def _zh_tokens(text: str) -> list[str]:
    tokens = (normalize_zh_answer(t) for t in jieba.cut(text, cut_all=False))
    return [t for t in tokens if t]


def qa_f1_zh_score(prediction: str, ground_truth: str, all_classes=None) -> float:
    return token_f1(_zh_tokens(prediction), _zh_tokens(ground_truth))


def rouge_score(prediction: str, ground_truth: str, all_classes=None) -> float:
    """ROUGE-L F of the ``rouge`` pip package; the official code maps any failure (empty text) to 0."""
    try:
        scores = Rouge().get_scores([prediction], [ground_truth], avg=True)
    except Exception:  # noqa: BLE001 - the official scorer catches everything (bare except)
        return 0.0
    return scores["rouge-l"]["f"]


def rouge_zh_score(prediction: str, ground_truth: str, all_classes=None) -> float:
    prediction = " ".join(jieba.cut(prediction, cut_all=False))
    ground_truth = " ".join(jieba.cut(ground_truth, cut_all=False))
    return rouge_score(prediction, ground_truth)


def classification_score(prediction: str, ground_truth: str, all_classes=None) -> float:
    matches = [name for name in all_classes if name in prediction]
    i = 0
    while i < len(matches):  # the official for-loop over a list it shrinks: a removal skips the next item
        term = matches[i]
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
        i += 1
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _numbers_equal_fraction(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(1 for n in numbers if n == str(target)) / len(numbers)


def count_score(prediction: str, ground_truth: str, all_classes=None) -> float:
    return _numbers_equal_fraction(prediction, ground_truth)


def retrieval_score(prediction: str, ground_truth: str, all_classes=None) -> float:
    return _numbers_equal_fraction(prediction, re.findall(r"Paragraph (\d+)", ground_truth)[0])


def retrieval_zh_score(prediction: str, ground_truth: str, all_classes=None) -> float:
    return _numbers_equal_fraction(prediction, re.findall(r"段落(\d+)", ground_truth)[0])


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy 0.18 ``fuzz.ratio`` (pure-python path): equal strings 100, one empty 0, else difflib."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * SequenceMatcher(None, a, b).ratio()))


def code_sim_score(prediction: str, ground_truth: str, all_classes=None) -> float:
    """Similarity of the first prediction line that is not a comment/fence to the reference line."""
    line = next((ln for ln in prediction.lstrip("\n").split("\n")
                 if "`" not in ln and "#" not in ln and "//" not in ln), "")
    return fuzz_ratio(line, ground_truth) / 100


DATASET2METRIC = {
    "narrativeqa": qa_f1_score, "qasper": qa_f1_score, "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score, "hotpotqa": qa_f1_score, "2wikimqa": qa_f1_score,
    "musique": qa_f1_score, "dureader": rouge_zh_score, "gov_report": rouge_score, "qmsum": rouge_score,
    "multi_news": rouge_score, "vcsum": rouge_zh_score, "trec": classification_score,
    "triviaqa": qa_f1_score, "samsum": rouge_score, "lsht": classification_score,
    "passage_retrieval_en": retrieval_score, "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score, "lcc": code_sim_score, "repobench-p": code_sim_score,
}
