"""An lm-evaluation-harness model (``lm_eval.api.model.LM``, registered as ``kvbench``) whose requests run
through kvbench's engine, i.e. through the configured method and budget.

* ``generate_until``: greedy ``engine.generate`` (prefill, prefill compression, decoding with the method's
  decode-time compression), stopped at the request's ``until`` strings, the tokenizer's EOS string and the
  model's EOS ids, then cut at the stop strings: what lm-eval's ``HFLM`` does around ``model.generate``.
* ``loglikelihood``: ``engine.prefill(context)`` (compressed like a generation prompt), then the
  continuation fed with ``Session.feed(tokens, phase="extend")`` (no further compression); the continuation's
  log-probabilities come from the logits of those passes.

Tokenisation, left truncation to ``max_length - max_gen_toks`` and the empty-context rule are ``HFLM``'s
(``add_bos_token`` unset), so that with ``method=full`` the outputs equal ``lm_eval --model hf`` on the same
model (tests/tasks/test_lm_eval.py).

``query_of(context)`` (query-agnostic mode) returns the question text of a request's context: the context is
cut at its last occurrence, the part before it is prefilled and compressed alone and the rest (question, chat-template
tail) is fed afterwards (``Prompt.suffix_ids`` / an ``extend`` pass).

``loglikelihood_rolling`` is refused: a rolling window's context is one token, so nothing would be
compressed; perplexity through the compressed cache is ``task=pg19``.
"""

from __future__ import annotations

from collections.abc import Callable

import time

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from kvbench.engine import Engine, Generation
from kvbench.errors import ConfigError
from kvbench.models import LanguageModel
from kvbench.tasks.base import generation_measurements, stop_string_check

MAX_GEN_TOKS = 256  # HFLM.max_gen_toks


@register_model("kvbench")
class KVBenchLM(TemplateLM):
    """lm: the loaded model and tokenizer; engine: its Engine (method + budget); query_of: see module doc.
    ``measurements`` holds, per answered request in order, its realized budget and timings."""

    def __init__(self, lm: LanguageModel, engine: Engine, query_of: Callable[[str], str] | None = None) -> None:
        super().__init__()
        self.lm, self.engine, self.query_of = lm, engine, query_of
        self.tokenizer = lm.tokenizer
        self.measurements: list[dict] = []

    # -- HFLM's tokenisation ---------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self.lm.max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            add_special_tokens = False  # the text already holds its BOS
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer.encode(string, **special)

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    def _split(self, context: str, question: str) -> tuple[list[int], list[int]]:
        """Query-agnostic encoding: (ids of the context before its last ``question``, ids of the rest)."""
        cut = context.rfind(question)
        if cut <= 0:
            raise ConfigError(f"lm-eval request {question[:60]!r}... has nothing before its question to compress "
                              "alone (no few-shot examples or description): use task.mode=official")
        return self.tok_encode(context[:cut]), self.tokenizer.encode(context[cut:], add_special_tokens=False)

    # -- requests ---------------------------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests with the same stop strings and token limit decode as one engine batch (rows are computed
        exactly as alone)."""
        prepared = [self._generation_request(*instance.args) for instance in requests]
        groups: dict[tuple, list[int]] = {}
        for i, (_, suffix, until, max_gen, _) in enumerate(prepared):
            groups.setdefault((tuple(until), max_gen, suffix is None), []).append(i)
        texts, measured = [""] * len(requests), [{}] * len(requests)
        for (until, max_gen, no_suffix), idx in groups.items():
            gens = self.engine.generate([prepared[i][0] for i in idx], max_new_tokens=max_gen,
                                        stop_token_ids=self.lm.eos_token_ids,
                                        suffixes=None if no_suffix else [prepared[i][1] for i in idx],
                                        stop_when=stop_string_check(self.lm, until))
            for i, gen in zip(idx, gens):
                ids, suffix, _, _, truncated = prepared[i]
                text = self.tokenizer.decode(gen.tokens, skip_special_tokens=True)
                texts[i] = postprocess_generated_text(text, list(until), None)
                measured[i] = self._measurement(gen, len(ids) + len(suffix or []), truncated)
        self.measurements += measured
        return texts

    def _generation_request(self, context: str, gen_kwargs: dict) -> tuple:
        """(prompt ids, suffix ids or None, stop strings, max new tokens, truncated) as HFLM prepares them."""
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), MAX_GEN_TOKS)
        if kwargs.get("do_sample"):
            raise ConfigError(f"lm-eval generation kwargs {gen_kwargs} sample (do_sample=true); kvbench decodes "
                              "greedily only")
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tokenizer.decode(self.eot_token_id))
        max_gen = kwargs.pop("max_gen_toks")
        ids, suffix = (self.tok_encode(context), None) if self.query_of is None else self._split(
            context, self.query_of(context))
        room = self.max_length - max_gen - len(suffix or [])  # HFLM: left truncation to max_length - max_gen_toks
        return ids[-room:], suffix, until, max_gen, len(ids) > room

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation), context ids, continuation ids) from TemplateLM.loglikelihood,
        which has moved the context's trailing whitespace into the continuation."""
        out = []
        for (context, _), context_ids, continuation in requests:
            suffix = []
            if self.query_of is not None and context:
                context_ids, suffix = self._split(context.rstrip(), self.query_of(context))
            whole = (context_ids + suffix + continuation)[-(self.max_length + 1):]  # HFLM: left truncation
            prefix = whole[: len(whole) - len(continuation) - len(suffix)]
            start = time.perf_counter()
            session = self.engine.prefill([prefix], max_new_tokens=0)
            prefill_seconds = time.perf_counter() - start
            logits = [session.logits[:, None]]  # (1, 1, V): predicts the token after the prefix
            fed = whole[len(prefix) : -1]  # the suffix, then the continuation without its last token
            if fed:
                logits.append(session.feed(torch.tensor([fed], device=self.engine.device), phase="extend"))
            logprobs = F.log_softmax(torch.cat(logits, dim=1)[0, -len(continuation) :].float(), dim=-1)
            target = torch.tensor(continuation, device=logprobs.device)
            out.append((float(logprobs.gather(1, target[:, None]).sum()),
                        bool((logprobs.argmax(-1) == target).all())))
            truncated = len(context_ids) + len(suffix) + len(continuation) > len(whole)
            self.measurements.append(self._measurement(scoring_generation(session, len(whole) - 1, prefill_seconds),
                                                       len(prefix) + len(suffix), truncated))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        raise ConfigError("lm-eval loglikelihood_rolling (perplexity tasks) would compress a one-token context; "
                          "use task=pg19 for perplexity through the compressed cache")

    @staticmethod
    def _measurement(gen: Generation, prompt_length: int, truncated: bool) -> dict:
        return {"prompt_length": prompt_length, "truncated": truncated, "output_tokens": len(gen.tokens),
                **generation_measurements(gen)}


def scoring_generation(session, n_tokens: int, prefill_seconds: float) -> Generation:
    """A scoring pass's realized cache as a ``Generation`` (no tokens generated) for the result columns."""
    cache = session.cache
    final = Engine.row_bytes(cache, 0)
    return Generation(
        tokens=[], prompt_length=n_tokens, kept_per_layer_head=session.prefill_lengths[:, 0].tolist(),
        n_keep=int(round(float(session.host_n_keep[:, 0].mean()))), kv_bytes_full=session.kv_bytes_full[0],
        kv_bytes_compressed=session.kv_bytes_compressed[0], kv_bytes_final=final,
        decode_kv_bytes_mean=float("nan"), prefill_seconds=prefill_seconds,
        compress_seconds=session.compress_seconds, decode_seconds=0.0, decode_compress_seconds=0.0,
        tpot_seconds=0.0, peak_memory_bytes=0, peak_memory_above_weights_bytes=0, stopped_by="scored",
    )
