"""LongBench task: fixtures, data sources, prompt building (official + query-agnostic), aggregation, end to end."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from kvbench import runner
from kvbench.errors import ConfigError
from kvbench.tasks.longbench import ALL_DATASETS, E_DATASETS, LongBench, length_bucket

from tests.conftest import CONF

NARRATIVEQA = ("You are given a story, which can be either a novel or a movie script, and a question. Answer the "
               "question asconcisely as you can, using a single phrase if possible. Do not provide any explanation."
               "\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a "
               "single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:")


def text_of(lm, ids):
    return lm.tokenizer.decode(ids)  # special tokens kept: they are part of what is checked


def test_fixtures_cover_all_21_datasets_in_the_official_layout():
    samples = LongBench(datasets=list(ALL_DATASETS)).samples()
    assert sorted({s.meta["dataset"] for s in samples}) == sorted(ALL_DATASETS) and len(ALL_DATASETS) == 21
    assert all(s.references and s.meta["data_source"] == "sample" for s in samples)
    trec = next(s for s in samples if s.meta["dataset"] == "trec")
    assert trec.references[0] in trec.meta["all_classes"]
    e = LongBench(datasets=list(E_DATASETS), variant="e").samples()
    assert len(e) == 3 * 13 and {length_bucket(s.meta["length"]) for s in e} == {"0-4k", "4-8k", "8k+"}


def test_official_prompt_is_the_template_character_for_character(tiny_lm):
    task = LongBench(datasets=["narrativeqa"])
    sample = task.samples()[0]
    prompt = task.build_prompt(sample, tiny_lm)
    raw = NARRATIVEQA.format(context=sample.context, input=sample.question)
    assert text_of(tiny_lm, prompt.context_ids) == f"<s><|user|>\n{raw}\n<|assistant|>\n"  # chat template applied
    assert prompt.max_new_tokens == 128 and prompt.suffix_ids is None and not prompt.truncated


def test_no_template_datasets_and_samsum_stop(tiny_lm):
    task = LongBench(datasets=["trec", "lcc", "samsum"])
    by_name = {s.meta["dataset"]: s for s in task.samples()}
    trec = task.build_prompt(by_name["trec"], tiny_lm)
    assert text_of(tiny_lm, trec.context_ids).startswith("<s>Please determine the type of the question below.")
    lcc = task.build_prompt(by_name["lcc"], tiny_lm)
    assert text_of(tiny_lm, lcc.context_ids).endswith("Next line of code:\n") and lcc.max_new_tokens == 64
    samsum = task.build_prompt(by_name["samsum"], tiny_lm)
    newline = tiny_lm.encode("\n", add_special_tokens=False)
    assert samsum.stop_token_ids == set(newline) and samsum.min_new_tokens == 1 and samsum.max_new_tokens == 128
    assert trec.stop_token_ids == set() and trec.min_new_tokens == 0


def test_middle_truncation_keeps_head_and_tail_of_the_raw_prompt(tiny_lm):
    lm = dataclasses.replace(tiny_lm, longbench_max_length=100)  # byte tokenizer: 1 token per ASCII char + BOS
    task = LongBench(datasets=["trec"])
    sample = task.samples()[0]
    prompt = task.build_prompt(sample, lm)
    raw = "Please determine the type of the question below. Here are some examples of questions.\n\n" \
          f"{sample.context}\n{sample.question}"
    # half = 50 tokens each side: the head's 50 include BOS (skipped when decoded) -> 49 chars + last 50 chars
    assert prompt.truncated and text_of(lm, prompt.context_ids) == "<s>" + raw[:49] + raw[-50:]
    assert LongBench(datasets=["trec"], max_length=10_000).build_prompt(sample, lm).truncated is False


def test_query_agnostic_feeds_the_question_after_the_context(tiny_lm):
    official = LongBench(datasets=["narrativeqa"])
    agnostic = LongBench(datasets=["narrativeqa"], mode="query_agnostic")
    sample = official.samples()[0]
    full = official.build_prompt(sample, tiny_lm)
    split = agnostic.build_prompt(sample, tiny_lm)
    head, tail = text_of(tiny_lm, split.context_ids), text_of(tiny_lm, split.suffix_ids)
    assert head.endswith(sample.context) and sample.question not in head
    assert tail.startswith("\n\nNow, answer the question") and tail.endswith("Answer:\n<|assistant|>\n")
    assert split.context_ids + split.suffix_ids == full.context_ids  # same tokens, split in two
    assert sample.meta["mode"] == "official" and agnostic.samples()[0].meta["mode"] == "query_agnostic"


def test_query_agnostic_truncates_only_the_context(tiny_lm):
    lm = dataclasses.replace(tiny_lm, longbench_max_length=260)
    task = LongBench(datasets=["multifieldqa_en"], mode="query_agnostic")
    sample = task.samples()[0]
    prompt = task.build_prompt(sample, lm)
    head, tail = text_of(lm, prompt.context_ids), text_of(lm, prompt.suffix_ids)
    assert prompt.truncated and f"Question: {sample.question}\nAnswer:" in tail
    # the context part was middle-truncated: its start and its end survive, its middle does not
    assert head.startswith("<s><|user|>\nRead the following text") and head.endswith(sample.context[-20:])
    assert sample.context[100:140] not in head
    raw_head, raw_tail = head[len("<s><|user|>\n"):], tail[: -len("\n<|assistant|>\n")]
    # room for the context part: 260 - 187 (raw tail) = 73 -> two halves of int(73 / 2) = 36 tokens (BOS included)
    assert len(lm.encode(raw_tail, add_special_tokens=False)) == 187 and len(lm.encode(raw_head)) == 72


def test_aggregate_rounds_dataset_means_and_adds_category_and_overall_rows():
    task = LongBench(datasets=["qasper", "narrativeqa", "trec"])
    predictions = pd.DataFrame({"dataset": ["qasper"] * 3 + ["narrativeqa", "trec"],
                                "metric.score": [1.0, 0.0, 0.5, 1 / 3, 1.0]})
    rows = {r["dataset"]: r for r in task.aggregate(predictions)}
    assert rows["qasper"]["value"] == 50.0 and rows["qasper"]["n"] == 3
    assert rows["narrativeqa"]["value"] == 33.33 and rows["narrativeqa"]["category"] == "single_doc_qa"
    assert rows["avg:single_doc_qa"]["value"] == 41.66  # (50 + 33.33) / 2 = 41.665 -> 41.66 (binary float)
    assert rows["avg:few_shot"]["value"] == 100.0
    assert rows["avg:overall"]["value"] == 61.11  # (50 + 33.33 + 100) / 3 = 61.11
    # the leaderboard's Avg: mean of the category means, (41.665 + 100) / 2 = 70.83
    assert rows["avg:leaderboard_en"]["value"] == 70.83 and "avg:leaderboard_zh" not in rows
    assert rows["avg:leaderboard_en"]["scorer"] == "mean_of_category_means"
    assert all(r["mode"] == "official" and r["metric"] == "score" for r in rows.values())


def test_leaderboard_average_is_per_language_with_code_counted_as_english():
    task = LongBench(datasets=["qasper", "lcc", "dureader", "lsht"])
    predictions = pd.DataFrame({"dataset": ["qasper", "lcc", "dureader", "lsht"],
                                "metric.score": [0.2, 0.6, 0.3, 0.9]})
    rows = {r["dataset"]: r["value"] for r in task.aggregate(predictions)}
    assert rows["avg:leaderboard_en"] == 40.0  # single-doc QA 20, code 60
    assert rows["avg:leaderboard_zh"] == 60.0  # multi-doc QA 30, few-shot 90
    assert rows["avg:overall"] == 50.0


def test_longbench_e_scores_each_length_bucket():
    task = LongBench(datasets=["qasper"], variant="e")
    predictions = pd.DataFrame({"dataset": ["qasper"] * 6, "metric.score": [1.0, 0.0, 1.0, 0.5, 0.0, 1.0],
                                "meta.length": [1500, 3999, 4000, 7999, 8000, 20000]})
    rows = {(r["dataset"], r["length_bucket"]): r["value"] for r in task.aggregate(predictions)}
    assert rows[("qasper", "0-4k")] == 50.0 and rows[("qasper", "4-8k")] == 75.0 and rows[("qasper", "8k+")] == 50.0
    assert rows[("qasper", "all")] == 58.33 and rows[("avg:overall", "4-8k")] == 75.0


def test_bad_config_values_name_the_accepted_ones():
    with pytest.raises(ConfigError, match="narrativeqa"):
        LongBench(datasets=["narrative_qa"])
    with pytest.raises(ConfigError, match="query_agnostic"):
        LongBench(mode="kvpress")
    with pytest.raises(ConfigError, match="qasper"):
        LongBench(datasets=["narrativeqa"], variant="e")  # not a LongBench-E dataset
    with pytest.raises(ConfigError, match="data_dir"):
        LongBench(source="local")


def test_local_directory_in_the_hub_file_format(tmp_path):
    record = {"input": "Q?", "context": "C.", "answers": ["A"], "length": 2, "dataset": "qasper",
              "language": "en", "all_classes": None, "_id": "x1"}
    (tmp_path / "qasper.jsonl").write_text(json.dumps(record) + "\n")
    pd.DataFrame([{**record, "_id": "x2", "dataset": "hotpotqa"}]).to_parquet(tmp_path / "hotpotqa.parquet")
    samples = LongBench(datasets=["qasper", "hotpotqa"], source="local", data_dir=str(tmp_path)).samples()
    assert [s.id for s in samples] == ["x1", "x2"] and samples[1].references == ["A"]
    assert samples[0].meta["data_path"].endswith("qasper.jsonl") and samples[0].meta["data_source"] == "local"
    with pytest.raises(ConfigError, match="trec.jsonl"):
        LongBench(datasets=["trec"], source="local", data_dir=str(tmp_path)).samples()


def test_end_to_end_on_fixtures_with_the_tiny_model(tmp_path):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "model=tiny-llama-random", "method=full", "task=longbench", "task.datasets=[trec,passage_count]",
            "task.samples_per_dataset=1", "task.max_new_tokens=3", f"results_root={tmp_path}"])
    run_dir = runner.run(cfg)
    predictions = pd.read_parquet(run_dir / "predictions.parquet")
    metrics = pd.read_parquet(run_dir / "metrics.parquet")
    assert list(predictions["dataset"]) == ["trec", "passage_count"]
    assert set(predictions["meta.mode"]) == {"official"} and (predictions["output_tokens"] <= 3).all()
    assert set(metrics["dataset"]) == {"trec", "passage_count", "avg:few_shot", "avg:synthetic", "avg:overall",
                                       "avg:leaderboard_en"}
    assert {"category", "mode", "length_bucket"} <= set(metrics) and metrics["value"].between(0, 100).all()


def test_samsum_newline_stop_and_min_new_tokens_run_end_to_end(tiny_lm):
    from kvbench.engine import Engine
    from kvbench.methods.full import Full
    from kvbench.budget import Budget

    task = LongBench(datasets=["samsum"], samples_per_dataset=1, max_new_tokens=4)
    engine = Engine(tiny_lm.model, Full(), Budget(kind="fraction", value=1.0), "sdpa", "original")
    row = task.predict(task.samples(), tiny_lm, engine)[0]
    assert 1 <= row["output_tokens"] <= 4 and "\n" not in row["prediction"]
