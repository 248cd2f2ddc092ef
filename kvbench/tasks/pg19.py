"""PG19 perplexity of long documents, evaluated THROUGH the compressed cache (protocols.md section 5).

Each document is tokenized (with the tokenizer's BOS), cut to ``prefill_tokens + num_eval_tokens`` tokens,
its first ``prefill_tokens`` tokens go through ``engine.prefill`` (prefill compression, like Cold Compress's
title + first words), and the rest is fed with ``session.feed(..., phase="decode")`` so that decode-time
compression runs after every pass. Every token after the prefill is scored: the NLL of token t comes from
the logits of the pass that fed token t-1 (teacher forcing).

* ``protocol=streaming``: one token per pass (StreamingLLM ``eval_long_ppl.py``; with ``prefill_tokens=1``
  the cache policy runs after every token, as there).
* ``protocol=chunked``: ``stride`` tokens per pass; the method then compresses once per chunk and sees the
  whole chunk's attention statistics.
* ``reset_per_document=false``: the documents of the run share one cache, as StreamingLLM (documents are
  concatenated; each document's own first ``prefill_tokens`` tokens are fed but not scored, and its last
  token is a target only: StreamingLLM never feeds it either, so nothing crosses the boundary).

Budget: a fractional budget is a fraction of the tokens each document pushes through the cache
(``fraction_of=evaluated``: prefill + evaluated tokens, converted to a token budget per document), or the
engine's own rule on the prefill prompt (``fraction_of=engine``). A concatenated stream has no length, so it
needs a token budget. Positions follow the global ``position_mode`` (recorded by the runner).

Result rows: one per document with its NLL sum, per-window NLL sums/counts and the realized cache; metric
rows ``ppl`` (token-weighted over documents), ``ppl@k`` (over each document's first k scored tokens, the
Cold Compress curve) and ``ppl_window@k`` (tokens k-window_size+1..k, the StreamingLLM curve).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor

from kvbench.budget import Budget
from kvbench.engine import Engine, Generation, Session
from kvbench.errors import ConfigError, unknown_name
from kvbench.memory import PeakMemory
from kvbench.tasks.base import NO_QUERY, Prompt, Sample, Task, generation_measurements
from kvbench.tasks.sources import PACKAGE_DATA, DataRef, load_records, read_records

PROTOCOLS = ("streaming", "chunked")
FRACTION_OF = ("evaluated", "engine")
SAMPLE_DIR = PACKAGE_DATA / "pg19" / "sample"
LOCAL_FILES = ("test.jsonl", "test.parquet", "test.json")
HUB_SHARDS = "data/test-*.parquet"  # the hub layout of emozilla/pg19-test, accepted under data_dir too


def token_nll(logits: Tensor, targets: Tensor) -> Tensor:
    """logits (B, q, V), targets (B, q) -> (B, q) negative log-likelihood in float32."""
    return F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")


@dataclass
class PG19(Task):
    """Perplexity task; see the module docstring for every protocol switch."""

    name: ClassVar[str] = "pg19"
    shares_prompt_pass: ClassVar[bool] = False  # streams documents through its own engine passes
    lockstep_batches: ClassVar[bool] = True
    source: str = "hub"
    data_dir: str | None = None
    text_file: str | None = None
    hub_id: str = "emozilla/pg19-test"
    hub_config: str = "default"
    revision: str | None = None
    protocol: str = "streaming"
    stride: int = 512
    prefill_tokens: int = 1
    num_eval_tokens: int | None = 4000
    reset_per_document: bool = True
    window_size: int = 500
    fraction_of: str = "evaluated"
    _ids: dict = field(default_factory=dict, init=False, repr=False)
    _stream: Session | None = field(default=None, init=False, repr=False)
    _stream_engine: Engine | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise unknown_name("pg19.protocol", self.protocol, PROTOCOLS)
        if self.fraction_of not in FRACTION_OF:
            raise unknown_name("pg19.fraction_of", self.fraction_of, FRACTION_OF)
        for key in ("stride", "prefill_tokens", "window_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"pg19.{key}={getattr(self, key)} must be >= 1")
        if self.num_eval_tokens is not None and self.num_eval_tokens < 1:
            raise ConfigError(f"pg19.num_eval_tokens={self.num_eval_tokens} must be >= 1 (or null: whole documents)")
        if self.text_file and self.source != "local":
            raise ConfigError(f"pg19.text_file is a local source: set task.source=local (got '{self.source}')")

    # -- data ---------------------------------------------------------------------------------------------

    def _records(self) -> tuple[list[dict], dict, str]:
        """(records with a 'text' field, provenance, dataset name)."""
        if self.text_file:
            path = Path(self.text_file)
            if not path.is_file():
                raise ConfigError(f"pg19.text_file={self.text_file}: no such file")
            text = path.read_text(encoding="utf-8")
            return [{"text": text, "short_book_title": path.name}], {"data_source": "text_file",
                                                                      "data_path": str(path)}, path.stem
        ref = DataRef(self.hub_id, self.hub_config, "test", LOCAL_FILES, hub_file=HUB_SHARDS)
        if self.source == "local" and self.data_dir:
            shards = sorted(Path(self.data_dir).glob(HUB_SHARDS))
            if shards and not any((Path(self.data_dir) / f).is_file() for f in LOCAL_FILES):
                records = [r for shard in shards for r in read_records(shard)]
                return records, {"data_source": "local", "dataset_id": self.hub_id,
                                 "data_path": str(Path(self.data_dir) / HUB_SHARDS)}, "pg19"
        records, provenance = load_records(ref, self.source, self.data_dir, self.revision, SAMPLE_DIR)
        return records, provenance, "pg19"

    def samples(self) -> list[Sample]:
        records, provenance, dataset = self._records()
        out = []
        for i, record in enumerate(records):
            if not isinstance(record.get("text"), str):
                raise ConfigError(f"pg19 record {i} has no 'text' string field (fields: {sorted(record)})")
            title = record.get("short_book_title") or record.get("title") or ""
            out.append(Sample(id=f"{dataset}-{i}", context=record["text"],
                              meta={"dataset": dataset, "title": str(title), **provenance}))
        return out

    def document_ids(self, sample: Sample, lm) -> list[int]:
        """The document's evaluated tokens: BOS + text, cut to prefill_tokens + num_eval_tokens."""
        if sample.id not in self._ids:
            text, need = sample.context, None
            if self.num_eval_tokens is not None:
                need = self.prefill_tokens + self.num_eval_tokens
                head = lm.encode(text[: 8 * need + 64])  # a token is rarely over 8 characters
                # far from the cut the prefix tokenizes as the whole text does
                text = text[: 8 * need + 64] if len(head) >= need + 16 else text
            ids = lm.encode(text)
            self._ids[sample.id] = (ids[:need] if need else ids, need is not None and len(ids) > need)
        return self._ids[sample.id][0]

    def build_prompt(self, sample: Sample, lm) -> Prompt:
        ids = self.document_ids(sample, lm)
        p = min(self.prefill_tokens, len(ids))
        return Prompt(context_ids=ids[:p], max_new_tokens=len(ids) - p, truncated=self._ids[sample.id][1])

    def check_fits(self, prompt: Prompt, sample: Sample, lm, position_mode: str) -> None:
        """Streaming past the model's context is legitimate with pos-shift positions (``cache_length``);
        under ``original`` positions a document must fit (concatenated streams are checked in ``predict``)."""
        if position_mode == "original":
            super().check_fits(prompt, sample, lm, position_mode)

    # -- evaluation -----------------------------------------------------------------------------------------

    def predict(self, samples: list[Sample], lm, engine: Engine) -> list[dict]:
        if not self.reset_per_document:
            return [self._stream_document(s, lm, engine) for s in samples]
        groups: dict[int, list[Sample]] = {}
        for s in samples:  # documents of equal length run as one batch, in lockstep
            groups.setdefault(len(self.document_ids(s, lm)), []).append(s)
        rows = {}
        for n, group in groups.items():
            for s, row in zip(group, self._evaluate_batch(group, lm, engine, n)[0]):
                rows[s.id] = row
        return [rows[s.id] for s in samples]

    def _document_engine(self, engine: Engine, n_tokens: int) -> Engine:
        """The engine whose budget is this document's: a fraction of all its tokens, as a token budget."""
        if self.fraction_of == "engine" or engine.budget.kind == "tokens":
            return engine
        doc_engine = copy.copy(engine)
        doc_engine.budget = Budget("tokens", int(engine.budget.n_keep(torch.tensor([n_tokens]), 0, "prompt")[0]))
        return doc_engine

    def _evaluate_batch(self, group: list[Sample], lm, engine: Engine, n: int) -> tuple[list[dict], Session]:
        """Documents of n tokens each, from an empty cache: one row per document, and the session."""
        p = min(self.prefill_tokens, n)
        ids = torch.tensor([self.document_ids(s, lm) for s in group], device=engine.device)  # (B, n)
        with PeakMemory(engine.device, baseline=engine.weight_bytes) as memory:
            start = time.perf_counter()
            session = self._document_engine(engine, n).prefill(ids[:, :p].tolist(), max_new_tokens=n - p)
            prefill_seconds = time.perf_counter() - start
            first = token_nll(session.logits[:, None][:, : n - p], ids[:, p : p + 1])  # (B, 1); (B, 0) if n == p
            start = time.perf_counter()
            rest, peak, passes, kv_read = self._feed(session, ids, p)
            decode_seconds = time.perf_counter() - start
        B = len(group)  # per-document shares of the batch's times, as engine.generate reports them
        timings = {"prefill_seconds": prefill_seconds / B, "compress_seconds": session.compress_seconds / B,
                   "decode_seconds": decode_seconds / B, "passes": passes, "kv_bytes_read": kv_read,
                   "decode_compress_seconds": session.decode_compress_seconds / B, "peak_memory_bytes": memory.bytes}
        nll = torch.cat([first, rest], dim=1)  # (B, n - p): targets p .. n-1
        return [self._row(s, session, b, nll[b], n, peak, timings) for b, s in enumerate(group)], session

    def _stream_document(self, sample: Sample, lm, engine: Engine) -> dict:
        """One document through the run's shared cache (documents concatenated, StreamingLLM style)."""
        if engine.budget.kind != "tokens":
            raise ConfigError("pg19.reset_per_document=false streams all documents through one cache, which "
                              "has no length for a fractional budget: use a token budget (e.g. budget=tokens256)")
        ids_list = self.document_ids(sample, lm)
        n, p = len(ids_list), min(self.prefill_tokens, len(ids_list))
        ids = torch.tensor([ids_list], device=engine.device)
        if self._stream is None or self._stream_engine is not engine:
            rows, self._stream = self._evaluate_batch([sample], lm, engine, n)  # the first opens the stream
            self._stream_engine = engine
            return rows[0]
        session = self._stream
        end = int(session.next_index[0]) + n
        if engine.position_mode == "original" and end > lm.max_length:
            raise ConfigError(f"pg19 stream reaches position {end} > model max_length={lm.max_length} with "
                              "position_mode=original: use position_mode=cache_length or fewer/shorter documents")
        compress_before, start = session.decode_compress_seconds, time.perf_counter()
        # the stream's cache is live before the document: the CPU count starts above it (CUDA counts it itself)
        with PeakMemory(engine.device, baseline=engine.weight_bytes + session.cache.allocated_bytes()) as memory:
            nll, peak, passes, kv_read = self._feed(session, ids, 0)  # targets 1 .. n-1; the first p: its prompt
        timings = {"prefill_seconds": 0.0, "compress_seconds": 0.0, "decode_seconds": time.perf_counter() - start,
                   "passes": passes, "kv_bytes_read": kv_read, "peak_memory_bytes": memory.bytes,
                   "decode_compress_seconds": session.decode_compress_seconds - compress_before}
        return self._row(sample, session, 0, nll[0, max(p - 1, 0):], n, peak, timings)

    def _feed(self, session: Session, ids: Tensor, start: int) -> tuple[Tensor, int, int, list[int]]:
        """Feed ids[:, start:] (B, n) ``step`` tokens per pass with decode-time compression.

        Returns the (B, n-1-start) NLL of targets ids[:, start+1:n], the longest cache row seen, the number of
        passes and, per row, the K+V bytes of the cache summed over passes. A document's last token is only a
        target, never fed, also in a stream (as StreamingLLM's eval_long_ppl, which feeds tokens 0..n-2 of each
        text): the next document does not see it."""
        step = 1 if self.protocol == "streaming" else self.stride
        end = ids.shape[1] - 1
        peak = int(session.cache.lengths().max())
        rows = range(ids.shape[0])
        kv_read = [0] * ids.shape[0]
        out = [ids.new_zeros(ids.shape[0], 0, dtype=torch.float32)]
        for s in range(start, end, step):
            e = min(s + step, end)
            logits = session.feed(ids[:, s:e], phase="decode")  # (B, e-s, V)
            targets = ids[:, s + 1 : e + 1]
            out.append(token_nll(logits[:, : targets.shape[1]], targets))
            peak = max(peak, int(session.cache.lengths().max()))
            kv_read = [total + Engine.row_bytes(session.cache, b) for b, total in zip(rows, kv_read)]
        return torch.cat(out, dim=1), peak, len(out) - 1, kv_read

    def _row(self, sample: Sample, session: Session, b: int, nll: Tensor, n: int, peak: int, timings: dict) -> dict:
        nll = nll.double().cpu()
        count = int(nll.numel())
        windows = [nll[i : i + self.window_size] for i in range(0, count, self.window_size)]
        cache = session.cache
        per_token = sum(layer.kv.keys.shape[1] * layer.kv.slot_bytes for layer in cache.layers)
        memory = timings["peak_memory_bytes"]
        seen = int(session.next_index[b])  # tokens that went through this cache (the stream so far)
        final = Engine.row_bytes(cache, b)
        gen = Generation(
            tokens=[], prompt_length=n, kept_per_layer_head=cache.lengths()[:, b].tolist(),
            n_keep=int(round(float(session.layer_n_keep[:, b].float().mean()))),
            kv_bytes_full=seen * per_token, kv_bytes_compressed=final, kv_bytes_final=final,
            prefill_seconds=timings["prefill_seconds"], compress_seconds=timings["compress_seconds"],
            decode_seconds=timings["decode_seconds"], decode_compress_seconds=timings["decode_compress_seconds"],
            tpot_seconds=timings["decode_seconds"] * len(session.next_index) / max(1, timings["passes"]),
            decode_kv_bytes_mean=timings["kv_bytes_read"][b] / max(1, timings["passes"]),
            peak_memory_bytes=memory, peak_memory_above_weights_bytes=memory - session.engine.weight_bytes,
            stopped_by="end_of_document",
        )
        return {
            "sample_id": sample.id,
            "dataset": self.dataset_of(sample),
            "prompt_length": n,
            "truncated": self._ids[sample.id][1],
            "output_tokens": count,
            "n_tokens": count,
            "nll_sum": float(nll.sum()),
            "ppl": math.exp(float(nll.mean())) if count else float("nan"),
            "window_nll_sum": [float(w.sum()) for w in windows],
            "window_tokens": [int(w.numel()) for w in windows],
            "kept_peak": peak,
            "mode": NO_QUERY,
            **generation_measurements(gen),
            **{f"meta.{k}": v for k, v in sample.meta.items() if isinstance(v, (int, float, str))},
        }

    # -- metrics ----------------------------------------------------------------------------------------------

    def aggregate(self, predictions: pd.DataFrame) -> list[dict]:
        """Token-weighted perplexities per dataset: overall, first k tokens (ppl@k), window ending at k."""
        rows = []
        for dataset, group in predictions.groupby("dataset", sort=True):
            tokens = int(group["n_tokens"].sum())
            rows.append(_ppl_row(dataset, "ppl", float(group["nll_sum"].sum()), tokens, len(group)))
            n_windows = max((len(w) for w in group["window_tokens"]), default=0)
            cum_nll = cum_tokens = 0.0
            for i in range(n_windows):
                nll = sum(float(w[i]) for w in group["window_nll_sum"] if len(w) > i)
                count = sum(int(w[i]) for w in group["window_tokens"] if len(w) > i)
                docs = sum(1 for w in group["window_tokens"] if len(w) > i)
                k = (i + 1) * self.window_size
                cum_nll, cum_tokens = cum_nll + nll, cum_tokens + count
                rows.append(_ppl_row(dataset, f"ppl@{k}", cum_nll, int(cum_tokens), docs))
                rows.append(_ppl_row(dataset, f"ppl_window@{k}", nll, count, docs))
        return rows


def _ppl_row(dataset: str, metric: str, nll_sum: float, tokens: int, docs: int) -> dict:
    value = math.exp(nll_sum / tokens) if tokens else float("nan")
    return {"dataset": dataset, "metric": metric, "value": value, "n": docs, "tokens": tokens, "mode": NO_QUERY}
