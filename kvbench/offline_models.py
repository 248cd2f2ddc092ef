"""Models that need no network: a seeded random tiny Llama, and SmolLM2-135M-Instruct from a pip package."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BYTE_SPECIALS = ["<pad>", "<s>", "</s>"]
# A minimal chat template in the ChatML shape: enough to exercise the chat-template code path.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (256 byte tokens + pad/bos/eos) built in memory: works offline, any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    specials = {tok: i for i, tok in enumerate(BYTE_SPECIALS)}
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = dict(specials)
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", specials["<s>"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def tiny_random(cfg):
    """A Llama-architecture model (RoPE, GQA) with random weights from ``cfg.seed``; scores are meaningless."""
    tokenizer = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
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
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(cfg.seed)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    return model, tokenizer


def smollm2(cfg):
    raise NotImplementedError("SmolLM2 conversion is not wired yet")
