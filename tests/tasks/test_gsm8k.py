"""GSM8K (lm-eval 0.4.13 protocol): answer extraction, exact prompt text, few-shot sampling, stop strings."""

from __future__ import annotations

import json
import random

import pytest

from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.errors import ConfigError
from kvbench.methods.full import Full
from kvbench.tasks.base import Sample
from kvbench.tasks.gsm8k import (COT_STRICT, FLEXIBLE, GSM8K, STRICT, GSM8KCoT, cut_at_stops, normalize,
                                 regex_extract)


@pytest.mark.parametrize("text,strict,flexible", [
    ("She pays 2 * $1,200 = $2,400.\n#### 2,400", "2,400", "2,400"),
    ("#### -3", "-3", "-3"),
    ("#### 5.\n\n", "5.", "5."),
    ("The loss is -$5 in total", "[invalid]", "-$5"),
    ("He paid $12 and got 3 back, so 9", "[invalid]", "9"),
    ("x = 7.", "[invalid]", "7."),
    ("half is 0.5 and then 1,000.25 remain", "[invalid]", "1,000.25"),
    ("no numbers here", "[invalid]", "[invalid]"),
    ("#### 18\n#### 19", "18", "19"),
])
def test_strict_and_flexible_extraction(text, strict, flexible):
    assert regex_extract(text, STRICT, 0) == strict
    assert regex_extract(text, FLEXIBLE, -1) == flexible


def test_normalization_drops_commas_dollars_hash_prefix_and_one_trailing_period():
    assert normalize("2,400") == "2400"
    assert normalize("-$5") == "-5"
    assert normalize("5.") == "5"
    assert normalize("5..") == "5."
    assert normalize("Janet sells 9 eggs.\n#### 18") == "18"  # a full reference answer
    assert normalize("[invalid]") == "[invalid]"


def test_cot_strict_pattern_keeps_lm_evals_any_character_dot():
    assert regex_extract("So 8 + 10 = 18. The answer is 18.", COT_STRICT, 0) == "18"
    assert regex_extract("The answer is 1,250.\n\n", COT_STRICT, 0) == "1,250"
    assert regex_extract("The answer is 18", COT_STRICT, 0) == "1"  # '.' eats the last digit, as in lm-eval


def test_scores_on_a_sample():
    task = GSM8K(source="sample")
    sample = Sample(id="s", context="", question="", meta={"reference_text": "3 x 400 = 1200\n#### 1,200"})
    assert task.score(" She earns $1,200.\n#### 1,200", sample) == {"strict_match": 1.0, "flexible_extract": 1.0}
    assert task.score(" She earns 1200 dollars, not 1300", sample) == {"strict_match": 0.0, "flexible_extract": 0.0}
    cot = GSM8KCoT(source="sample")
    sample = Sample(id="s", context="", question="", meta={"reference_text": "1200"})
    assert cot.score(" 3 x 400 = 1,200. The answer is 1,200.", sample) == {"strict_match": 1.0, "flexible_extract": 1.0}


def test_stop_strings_cut_like_lm_eval():
    text = " She makes 9 * 2 = 18 dollars.\n#### 18\n\nQuestion: A robe takes 2 bolts"
    assert cut_at_stops(text, ["Question:", "</s>", "<|im_end|>"]) == " She makes 9 * 2 = 18 dollars.\n#### 18\n\n"
    assert cut_at_stops(text, ["\n\n", "Question:"]) == " She makes 9 * 2 = 18 dollars.\n#### 18"
    assert GSM8K(source="sample").postprocess(text, None).endswith("#### 18\n\n")


JANET = ("Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her "
         "friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck egg. "
         "How much in dollars does she make every day at the farmers' market?")


def test_fewshot_prompt_text_is_exact():
    [first, *_] = GSM8K(source="sample", num_fewshot=2).samples()
    expected = (
        "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?\nAnswer: Natalia sold 48/2 = <<48/2=24>>24 "
        "clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72\n\n"
        "Question: Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How "
        "much did she earn?\nAnswer: Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she "
        "earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10\n\n"
        f"Question: {JANET}\nAnswer:"
    )
    assert GSM8K(source="sample").prompt_text(first) == expected
    assert first.references == ["18"]
    five = GSM8K(source="sample").samples()[0]
    assert five.context.count("\nAnswer: ") == 5
    assert "twice a week.  How many pages does he write a year?\nAnswer: He writes" in five.context  # double space


def test_cot_prompt_text_is_exact():
    sample = GSM8KCoT(source="sample").samples()[0]
    text = GSM8KCoT(source="sample").prompt_text(sample)
    assert text.startswith(
        "Q: There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are done, "
        "there will be 21 trees. How many trees did the grove workers plant today?\nA: There are 15 trees originally. "
        "Then there were 21 trees after some more were planted. So there must have been 21 - 15 = 6. The answer is 6."
        "\n\nQ: If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?"
        "\nA: There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5.\n\nQ: Leah")
    assert text.endswith("23 - 15 is 8. The answer is 8.\n\n" f"Q: {JANET}\nA:")
    assert text.count("\nA: ") == 8 and sample.meta["reference_text"] == "18"


def test_lm_eval_sampler_draws_from_train_in_test_order(tmp_path):
    train = [{"question": f"q{i}", "answer": f"a{i}\n#### {i}"} for i in range(10)]
    test = [{"question": f"t{i}", "answer": f"#### {i}"} for i in range(3)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in train), encoding="utf-8")
    (tmp_path / "test.jsonl").write_text("\n".join(json.dumps(r) for r in test), encoding="utf-8")
    samples = GSM8K(source="local", data_dir=str(tmp_path), num_fewshot=2, fewshot_sampler="lm_eval").samples()
    # random.Random(1234).sample(range(10), 2) three times in a row (CPython's Mersenne Twister)
    expected = [[7, 1], [0, 1], [9, 0]]
    rnd = random.Random(1234)
    assert [rnd.sample(range(10), 2) for _ in range(3)] == expected  # pins the Python RNG this relies on
    for sample, shots in zip(samples, expected):
        assert sample.context == "".join(f"Question: q{i}\nAnswer: a{i}\n#### {i}\n\n" for i in shots)


def test_sources_and_errors():
    package = GSM8K(source="package").samples()
    assert len(package) == 1319 and package[0].references == ["18"]
    assert package[0].meta["data_source"] == "package"
    with pytest.raises(ConfigError, match="unknown gsm8k.source 'web'"):
        GSM8K(source="web")
    with pytest.raises(ConfigError, match="train split"):
        GSM8K(source="sample", fewshot_sampler="lm_eval")
    with pytest.raises(ConfigError, match="num_fewshot=6 but only 5"):
        GSM8K(source="sample", num_fewshot=6).samples()


def test_generation_end_to_end_on_the_tiny_model(tiny_lm):
    task = GSM8K(source="sample", max_new_tokens=6)
    samples = task.samples()[:2]
    rows = task.predict(samples, tiny_lm, Engine(tiny_lm.model, Full(), Budget("fraction", 1.0)))
    assert [r["sample_id"] for r in rows] == ["gsm8k-0", "gsm8k-1"]
    for row in rows:
        assert row["metric.strict_match"] in (0.0, 1.0) and row["metric.flexible_extract"] in (0.0, 1.0)
        assert row["output_tokens"] <= 6 and row["stopped_by"] in ("eos", "max_new_tokens")
        assert row["prompt_length"] > 500  # five exemplars + the question
