"""ZeroSCROLLS task: fixtures, official truncation, query-agnostic split, aggregation, submission files, end to end."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from kvbench import runner
from kvbench.errors import ConfigError
from kvbench.tasks.zeroscrolls import TASKS, ZeroScrolls, main, write_submission

from tests.conftest import CONF


def test_fixtures_cover_the_10_tasks_and_group_references_by_id():
    samples = ZeroScrolls().samples()
    assert {s.meta["dataset"] for s in samples} == set(TASKS) and len(TASKS) == 10
    squality = next(s for s in samples if s.id == "squality_0")
    assert len(squality.references) == 2  # two rows with the same id
    assert squality.question.startswith("Question:\n") and squality.answer_prefix.strip() == "Answer:"
    test = ZeroScrolls(split="test").samples()
    assert len(test) == 10 and all(not s.references for s in test)


def test_untruncated_input_is_the_record_input_as_is(tiny_lm):
    task = ZeroScrolls(tasks=["quality"])
    sample = task.samples()[0]
    prompt = task.build_prompt(sample, tiny_lm)
    whole = sample.context + sample.question + sample.answer_prefix
    assert prompt.context_ids == tiny_lm.encode(whole) and not prompt.truncated
    assert prompt.max_new_tokens == 10 and prompt.suffix_ids is None


def test_truncation_keeps_the_document_start_then_separator_query_and_answer_prefix(tiny_lm):
    task = ZeroScrolls(tasks=["narrative_qa"], max_input_length=150)
    sample = task.samples()[0]
    prompt = task.build_prompt(sample, tiny_lm)
    separator = "... [The rest of the story is omitted]\n\n"
    tail = separator + sample.question + sample.answer_prefix
    assert prompt.truncated and len(prompt.context_ids) == 149  # the official runner's one spare token
    # byte tokenizer: BOS + the first (150 - 1 - 1 - len(tail)) characters of the input, then the tail
    expected = "<s>" + sample.context[: 148 - len(tail)] + tail
    assert tiny_lm.tokenizer.decode(prompt.context_ids) == expected


def test_chat_template_follows_the_official_chat_runner(tiny_lm):
    """openai_api.py: format request after the instruction (not for summaries), input cut at the query end,
    chat format around it, its tokens reserved."""
    qa = ZeroScrolls(tasks=["narrative_qa"], chat_template=True)
    sample = qa.samples()[0]
    instruction, _, rest = sample.context.partition("\n\n")
    text = tiny_lm.decode(qa.build_prompt(sample, tiny_lm).context_ids)
    user = f"{instruction.strip()} Do not provide any explanation.\n\n{rest}{sample.question}"
    assert text == tiny_lm.decode(tiny_lm.encode_prompt(tiny_lm.chat(user), templated=True))
    assert sample.answer_prefix.strip() and sample.answer_prefix not in text[-20:]
    summary = ZeroScrolls(tasks=["gov_report"], chat_template=True)
    sample = summary.samples()[0]
    text = tiny_lm.decode(summary.build_prompt(sample, tiny_lm).context_ids)
    assert "Do not provide any explanation." not in text and sample.context in text
    truncated = ZeroScrolls(tasks=["narrative_qa"], chat_template=True, max_input_length=200)
    prompt = truncated.build_prompt(qa.samples()[0], tiny_lm)
    overhead = len(tiny_lm.encode_prompt(tiny_lm.chat(""), templated=True)) - len(tiny_lm.encode(""))
    assert prompt.truncated and len(prompt.context_ids) <= 200 - 1 and overhead > 0


def test_query_agnostic_splits_before_the_query(tiny_lm):
    task = ZeroScrolls(tasks=["qasper"], mode="query_agnostic")
    sample = task.samples()[0]
    prompt = task.build_prompt(sample, tiny_lm)
    assert tiny_lm.decode(prompt.context_ids) == sample.context
    assert tiny_lm.decode(prompt.suffix_ids) == sample.question + sample.answer_prefix


def test_aggregate_takes_geometric_mean_of_rouge_and_averages_tasks():
    task = ZeroScrolls(tasks=["qmsum", "quality"])
    predictions = pd.DataFrame({
        "dataset": ["qmsum", "quality", "quality"],
        "metric.rouge1": [5 / 6, None, None], "metric.rouge2": [0.6, None, None],
        "metric.rougeL": [5 / 6, None, None], "metric.accuracy": [None, 1.0, 0.0],
    })
    rows = {(r["dataset"], r["metric"]): r["value"] for r in task.aggregate(predictions)}
    # (83.33 * 60 * 83.33) ** (1/3) = 416666.7 ** (1/3) = 74.69
    assert rows[("qmsum", "rouge_geometric_mean")] == 74.69 and rows[("qmsum", "rouge2")] == 60.0
    assert rows[("quality", "accuracy")] == 50.0
    assert rows[("avg:zeroscrolls", "score")] == 62.35  # (74.69... + 50) / 2 = 62.347


def test_submission_files_are_id_to_prediction_json(tmp_path):
    predictions = pd.DataFrame({"dataset": ["quality", "quality", "musique"], "sample_id": ["q1", "q2", "m1"],
                                "prediction": ["B", "C", "Prague"], "meta.split": ["test"] * 3})
    paths = write_submission(predictions, tmp_path / "out")
    assert sorted(p.name for p in paths) == ["musique.json", "quality.json"]
    assert json.loads((tmp_path / "out" / "quality.json").read_text()) == {"q1": "B", "q2": "C"}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    predictions.to_parquet(run_dir / "predictions.parquet")
    main([str(run_dir)])
    assert json.loads((run_dir / "zeroscrolls_test" / "musique.json").read_text()) == {"m1": "Prague"}


def test_bad_config_values_name_the_accepted_ones():
    with pytest.raises(ConfigError, match="narrative_qa"):
        ZeroScrolls(tasks=["narrativeqa"])
    with pytest.raises(ConfigError, match="validation"):
        ZeroScrolls(split="dev")


def test_end_to_end_validation_and_test_split(tmp_path):
    def run(*extra):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[
                "model=tiny-llama-random", "method=full", "task=zeroscrolls", "task.tasks=[quality,space_digest]",
                "task.samples_per_task=1", "task.max_new_tokens=3", f"results_root={tmp_path}", *extra])
        return runner.run(cfg)

    run_dir = run()
    metrics = pd.read_parquet(run_dir / "metrics.parquet")
    assert set(zip(metrics["dataset"], metrics["metric"])) == {
        ("quality", "accuracy"), ("space_digest", "exp_similarity"), ("avg:zeroscrolls", "score")}
    submitted = json.loads((run_dir / "zeroscrolls_validation" / "quality.json").read_text())
    assert list(submitted) == ["quality_0"]
    test_dir = run("task.split=test")
    assert pd.read_parquet(test_dir / "metrics.parquet").empty  # private answers: nothing scored
    assert list(json.loads((test_dir / "zeroscrolls_test" / "space_digest.json").read_text())) == [
        "space_digest_2"]
