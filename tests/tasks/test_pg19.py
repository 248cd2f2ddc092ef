"""PG19 perplexity through the compressed cache: exactness against a plain HF forward, windows, budgets."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.errors import ConfigError
from kvbench.methods.full import Full
from kvbench.methods.streamingllm import StreamingLLM
from kvbench.tasks.base import Sample
from kvbench.tasks.pg19 import PG19


def hf_token_nll(model, ids: list[int]) -> torch.Tensor:
    """(len(ids)-1,) NLL of tokens 1.. from one batched HF forward over the whole sequence."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(x).logits[0, :-1].float()
    return F.cross_entropy(logits, x[0, 1:], reduction="none")


def doc(text: str, i: int = 0) -> Sample:
    return Sample(id=f"doc-{i}", context=text, meta={"dataset": "pg19"})


TEXT = "In the beginning God created the heaven and the earth. And the earth was without form, and void."


@pytest.mark.parametrize("protocol,prefill", [("streaming", 1), ("streaming", 6), ("chunked", 1), ("chunked", 6)])
def test_full_cache_perplexity_equals_one_hf_forward(tiny_lm, protocol, prefill):
    task = PG19(source="sample", protocol=protocol, stride=7, prefill_tokens=prefill, num_eval_tokens=24,
                window_size=8)
    row = task.predict([doc(TEXT)], tiny_lm, Engine(tiny_lm.model, Full(), Budget("fraction", 1.0)))[0]
    ids = task.document_ids(doc(TEXT), tiny_lm)
    assert len(ids) == prefill + 24 and ids[0] == tiny_lm.tokenizer.bos_token_id
    with torch.no_grad():  # the HF loss over the scored targets is the reference perplexity
        loss = tiny_lm.model(torch.tensor([ids]), labels=torch.tensor([[-100] * prefill + ids[prefill:]])).loss
    assert row["n_tokens"] == 24 and row["window_tokens"] == [8, 8, 8]
    assert row["ppl"] == pytest.approx(math.exp(float(loss)), rel=1e-4)
    expected = hf_token_nll(tiny_lm.model, ids)[prefill - 1 :]
    assert row["window_nll_sum"] == pytest.approx([float(w.sum()) for w in expected.split(8)], rel=1e-4)
    assert row["kept_mean"] == prefill + 23  # every token but the document's last (only a target) is cached


def test_concatenated_stream_equals_hf_forward_over_both_documents(tiny_lm):
    task = PG19(source="sample", reset_per_document=False, prefill_tokens=3, num_eval_tokens=20, window_size=100)
    engine = Engine(tiny_lm.model, Full(), Budget("tokens", 1000))
    first, second = doc(TEXT, 0), doc("Ruth said, Intreat me not to leave thee.", 1)
    rows = task.predict([first], tiny_lm, engine) + task.predict([second], tiny_lm, engine)  # two runner batches
    a, b = task.document_ids(first, tiny_lm), task.document_ids(second, tiny_lm)
    # StreamingLLM's stream: each document's last token is only a target, never fed (nothing crosses over)
    stream = a[:-1] + b
    nll = hf_token_nll(tiny_lm.model, stream)  # targets 1 .. len(stream)-1
    # second document: its own first 3 tokens are its prompt; scored targets are stream[len(a)-1+3] ..
    expected = nll[len(a) - 1 + 3 - 1 :]
    assert rows[1]["n_tokens"] == len(b) - 3 == len(expected)
    assert rows[1]["nll_sum"] == pytest.approx(float(expected.sum()), rel=1e-4)
    assert rows[1]["kept_mean"] == len(a) - 1 + len(b) - 1  # the whole stream is cached, last tokens excepted
    assert rows[1]["kv_bytes_final"] == rows[1]["kv_bytes_full"]  # full cache of everything seen


def test_streamingllm_keeps_the_cache_at_the_budget(tiny_lm):
    task = PG19(source="sample", num_eval_tokens=34, window_size=20)
    engine = Engine(tiny_lm.model, StreamingLLM(sinks=4), Budget("fraction", 0.2))
    row = task.predict([doc(TEXT)], tiny_lm, engine)[0]
    assert row["n_keep"] == 7  # 0.2 x (1 prefill + 34 evaluated) = 7 per head
    assert row["kept_peak"] == 7 and row["kept_max"] == 7  # bounded after every step, not just at the end
    assert row["kv_bytes_final"] * 34 == row["kv_bytes_full"] * 7  # 34 tokens went through the cache
    assert row["n_tokens"] == 34 and math.isfinite(row["ppl"])


def test_token_budget_passes_through_and_engine_rule_is_selectable(tiny_lm):
    engine = Engine(tiny_lm.model, StreamingLLM(sinks=4), Budget("tokens", 9))
    row = PG19(source="sample", num_eval_tokens=16).predict([doc(TEXT)], tiny_lm, engine)[0]
    assert row["n_keep"] == 9 and row["kept_peak"] == 9
    fraction = Engine(tiny_lm.model, StreamingLLM(sinks=4), Budget("fraction", 0.5))
    row = PG19(source="sample", prefill_tokens=10, num_eval_tokens=4, fraction_of="engine").predict(
        [doc(TEXT)], tiny_lm, fraction)[0]
    assert row["n_keep"] == 5  # the engine's rule: half of the 10-token prefill prompt


def test_a_document_no_longer_than_the_prefill_scores_nothing(tiny_lm):
    row = PG19(source="sample", prefill_tokens=6).predict([doc("ab")], tiny_lm,
                                                          Engine(tiny_lm.model, Full(), Budget("fraction", 1.0)))[0]
    assert row["n_tokens"] == 0 and row["window_tokens"] == [] and math.isnan(row["ppl"])


def test_perplexity_windows_are_token_weighted():
    task = PG19(source="sample", window_size=2)
    predictions = pd.DataFrame([
        {"dataset": "pg19", "n_tokens": 3, "nll_sum": 6.0, "window_nll_sum": [2.0, 4.0], "window_tokens": [2, 1]},
        {"dataset": "pg19", "n_tokens": 2, "nll_sum": 1.0, "window_nll_sum": [1.0], "window_tokens": [2]},
    ])
    got = {r["metric"]: (r["value"], r["n"], r["tokens"]) for r in task.aggregate(predictions)}
    assert got["ppl"] == (pytest.approx(math.exp(7 / 5)), 2, 5)
    assert got["ppl@2"] == (pytest.approx(math.exp(3 / 4)), 2, 4)
    assert got["ppl_window@2"] == (pytest.approx(math.exp(3 / 4)), 2, 4)
    assert got["ppl@4"] == (pytest.approx(math.exp(7 / 5)), 1, 5)
    assert got["ppl_window@4"] == (pytest.approx(math.exp(4.0)), 1, 1)


def test_sources_sample_text_file_local_shards_and_offline_hub(tmp_path, monkeypatch):
    sample = PG19(source="sample").samples()
    assert len(sample) == 5 and sample[0].meta["title"].startswith("The Book of Ruth")
    assert sample[0].context.startswith("THE HOLY BIBLE, KING JAMES VERSION")
    text = tmp_path / "wiki.test.raw"
    text.write_text(" = Valkyria Chronicles = \n text \n", encoding="utf-8")
    [one] = PG19(source="local", text_file=str(text)).samples()
    assert one.meta["dataset"] == "wiki.test" and one.context.startswith(" = Valkyria")
    (tmp_path / "data").mkdir()
    for i in range(2):
        pd.DataFrame({"short_book_title": [f"b{i}"], "text": [f"book {i}"]}).to_parquet(
            tmp_path / "data" / f"test-0000{i}-of-00002.parquet")
    assert [s.context for s in PG19(source="local", data_dir=str(tmp_path)).samples()] == ["book 0", "book 1"]
    import huggingface_hub

    def offline(*args, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("no connection and nothing cached")

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", offline)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ConfigError, match="task.source=local task.data_dir=DIR.*task.source=sample"):
        PG19(source="hub").samples()


def test_bad_configs_are_one_line_errors(tiny_lm):
    with pytest.raises(ConfigError, match="protocol 'sliding'"):
        PG19(protocol="sliding")
    with pytest.raises(ConfigError, match="task.source=local"):
        PG19(source="hub", text_file="x.txt")
    with pytest.raises(ConfigError, match="stride=0"):
        PG19(stride=0)
    stream = PG19(source="sample", reset_per_document=False, num_eval_tokens=5)
    with pytest.raises(ConfigError, match="token budget"):
        stream.predict([doc(TEXT)], tiny_lm, Engine(tiny_lm.model, Full(), Budget("fraction", 0.5)))
