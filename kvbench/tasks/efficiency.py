"""Efficiency benchmark: latency in the style of Chelsea Table 3, throughput at the largest batch that fits, and
every cell read against the bytes-read bound of the device.

Synthetic prompts of the configured lengths (random token ids: speed does not depend on content) and a fixed
number of new tokens with EOS disabled. Each run measures the configured method and, as the ratio
denominators, the full cache through kvbench's engine in the same process, so ratios come from one run.

``measure=latency`` (default): warm-up and repeats at each configured batch size, three systems on identical
prompts:
  ``method``  the configured method through kvbench's engine,
  ``full``    the full cache through kvbench's engine,
  ``bare``    plain ``model.generate`` with the model's own cache (harness overhead = full / bare).

``measure=throughput``: per context length, the largest batch that fits a memory cap is searched for the method
and for the full cache (grow geometrically from ``batch_start`` by ``batch_growth`` until a batch fails, then
bisect until the gap is at most ``batch_precision`` of the batch that fitted; on CUDA a growth step stops at
the batch the peak-memory line of the last two tries predicts; every try is a real ``engine.generate``
decoding ``new_tokens``), and the tries at that batch (the search's own and ``repeats - 1`` more) give
tokens/s, TPOT and peak memory. The cap (``memory_cap_gib``, default the device's
free memory) is what a batch may use beyond what the process holds when the search starts (the weights). An
out-of-memory is a result (the try's row: ``fits`` false, the error), never a crash:
  CUDA: the caching allocator is capped with ``torch.cuda.set_per_process_memory_fraction`` (restored
        afterwards) and ``torch.OutOfMemoryError`` is caught (memory freed, the cache emptied);
  CPU:  each try runs in a forked child whose address space is capped (RLIMIT_AS = its size at fork + the
        cap), so the allocator really fails; children run single-threaded, because GNU OpenMP hangs in a
        forked child that enters a parallel region with the parent's thread pool.

Tokens/s [I]: the papers' throughput claims (EMS, D2O, Chelsea) compare decoding; ``decode_tokens_per_second``
= batch / TPOT is that number, ``throughput_tokens_per_second`` = batch x new tokens / (TTFT + decode time) the
end-to-end one (at long contexts and few new tokens, prefill dominates it). TPOT is split too: the first decode
step (``first_step_seconds``, from the first token, the end of the row's prefill, to the second, as plain
generate's gap between its first two tokens: kvbench places the row into the decode batch's storage and records
the batch's CUDA graph there, on an idle device when the host had to wait for the prompt pass, as D2O's layer
budgets make it) and the mean of the steps after it (``tpot_after_first_seconds``); their ratios to the full
cache's sit beside TPOT's.

The bytes-read bound, for every cell: a decode step must read every weight once and the K+V bytes attention
reads, so TPOT >= (parameter bytes + KV bytes read per step) / memory bandwidth. Parameter bytes count every
weight matrix once; an input embedding that is not tied to the LM head contributes only the batch's looked-up
rows. KV bytes are ``Generation.decode_kv_bytes_mean`` summed over the batch's rows. The bandwidth is
``memory_bandwidth_gbps`` or measured once per run by a device-to-device copy (bytes read + written). Each
cell reports the bound and the achieved fraction bound / TPOT (1 = the hardware limit).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import pandas as pd
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from kvbench.budget import Budget
from kvbench.engine import Engine, _sync
from kvbench.errors import ConfigError
from kvbench.hardware import (MemoryCap, copy_bandwidth, free_memory_bytes, memory_limit, parameter_bytes_read,
                              tpot_bound_seconds)
from kvbench.memory import PeakMemory
from kvbench.methods.full import Full
from kvbench.tasks.base import NO_QUERY, Prompt, Sample, Task

MEASURE_KINDS = ("latency", "throughput")
SYSTEMS = ("method", "full", "bare")
# first_step_seconds, tpot_after_first_seconds: the TPOT's first decode step (where kvbench places the row and
# records the step's CUDA graph; plain generate's first cached step) and the mean of the steps after it, so that a
# TPOT ratio shows whether a method's one-off first step or its every step costs it
MEASURES = ("ttft_seconds", "tpot_seconds", "tpot_bound_seconds", "peak_memory_bytes",
            "peak_memory_above_weights_bytes", "throughput_tokens_per_second", "decode_tokens_per_second",
            "first_step_seconds", "tpot_after_first_seconds")
# measure=throughput: the measures whose method/full ratio is reported
THROUGHPUT_RATIOS = ("max_batch", "decode_tokens_per_second", "throughput_tokens_per_second", "tpot_seconds",
                     "tpot_bound_seconds", "peak_memory_bytes")
GIB = 2**30


@dataclass
class Efficiency(Task):
    name: ClassVar[str] = "efficiency"
    shares_prompt_pass: ClassVar[bool] = False  # its timings are the measurement: never fused
    measure: str = "latency"
    context_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    new_tokens: int = 32
    batch_sizes: list[int] = field(default_factory=lambda: [1])  # latency mode
    warmup: int = 1
    repeats: int = 3
    seed: int = 0
    memory_cap_gib: float | None = None  # throughput mode; None = the device's free memory
    batch_start: int = 1
    batch_growth: float = 2.0
    batch_precision: float = 0.0  # 0 = exact largest batch
    max_batch: int = 4096
    memory_bandwidth_gbps: float | None = None  # GB/s (1e9 bytes/s); None = measured once per run

    def __post_init__(self) -> None:
        if self.measure not in MEASURE_KINDS:
            raise ConfigError(f"efficiency.measure='{self.measure}' is unknown; accepted: {', '.join(MEASURE_KINDS)}")
        if self.new_tokens < 2:
            raise ConfigError(f"efficiency.new_tokens={self.new_tokens} must be >= 2 (TPOT needs two tokens)")
        for name in ("context_lengths", "batch_sizes"):
            bad = [v for v in getattr(self, name) if v < 1]
            if bad or not getattr(self, name):
                raise ConfigError(f"efficiency.{name}={list(getattr(self, name))} must be non-empty positive ints")
        if self.repeats < 1 or self.warmup < 0:
            raise ConfigError(f"efficiency: repeats={self.repeats} must be >= 1 and warmup={self.warmup} >= 0")
        for name in ("memory_cap_gib", "memory_bandwidth_gbps"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"efficiency.{name}={getattr(self, name)} must be positive or null")
        if not (1 <= self.batch_start <= self.max_batch and self.batch_growth > 1 and self.batch_precision >= 0):
            raise ConfigError(f"efficiency: batch_start={self.batch_start}, max_batch={self.max_batch}, "
                              f"batch_growth={self.batch_growth}, batch_precision={self.batch_precision}: need "
                              f"1 <= batch_start <= max_batch, batch_growth > 1, batch_precision >= 0")
        self._bandwidth: float | None = None  # bytes/s, measured on first use

    def samples(self) -> list[Sample]:
        if self.measure == "throughput":
            return [Sample(id=f"len{n}-throughput", context="",
                           meta={"dataset": f"len{n}_throughput", "context_length": n})
                    for n in self.context_lengths]
        return [
            Sample(id=f"len{n}-bs{b}", context="", meta={"dataset": f"len{n}_bs{b}", "context_length": n,
                                                          "batch_size": b})
            for n in self.context_lengths for b in self.batch_sizes
        ]

    def build_prompt(self, sample: Sample, lm) -> Prompt:
        n = sample.meta["context_length"]
        g = torch.Generator().manual_seed(self.seed + n)
        ids = torch.randint(0, len(lm.tokenizer), (n,), generator=g).tolist()
        return Prompt(context_ids=ids, max_new_tokens=self.new_tokens)

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        return {}

    def predict(self, samples: list[Sample], lm, engine: Engine) -> list[dict]:
        full = engine.with_method(Full(), Budget("fraction", 1.0))
        self._memory_bandwidth(engine.device)  # once per run, before anything is timed or capped
        cell = self._throughput_cell if self.measure == "throughput" else self._latency_cell
        return [{**row, "mode": NO_QUERY} for sample in samples
                for row in cell(sample, self.build_prompt(sample, lm).context_ids, engine, full)]

    # -- latency ----------------------------------------------------------------------------------------

    def _latency_cell(self, sample: Sample, prompt: list[int], engine: Engine, full: Engine) -> list[dict]:
        batch = [prompt] * sample.meta["batch_size"]
        rows = []
        full_bytes_read = []  # plain generate's cache holds the same slots as kvbench's full cache

        def timed(system: str) -> dict:
            if system == "bare":
                return self._time_bare(engine.model, batch, full_bytes_read[-1])
            timings = self._time_engine(engine if system == "method" else full, batch, detail=system == "method")
            if system == "full":
                full_bytes_read.append(timings["kv_bytes_read_per_step"])
            return timings

        for _ in range(self.warmup):
            for system in SYSTEMS:
                timed(system)
        # repeats interleave the systems, so that a drift of the machine (clocks, a busy host) touches all three
        for repeat in range(self.repeats):
            for system in SYSTEMS:
                rows.append({"sample_id": f"{sample.id}-{system}-{repeat}", "dataset": sample.meta["dataset"],
                             "system": system, "repeat": repeat, "prompt_length": len(prompt),
                             "batch_size": len(batch), "output_tokens": self.new_tokens, **timed(system)})
        return rows

    def _time_engine(self, engine: Engine, batch: list[list[int]], detail: bool) -> dict:
        """Timings and bound of one engine call; ``detail`` adds the realized budget (the method's rows only, so
        that run-level budget columns describe the configured method, not the full-cache reference)."""
        gens = engine.generate(batch, self.new_tokens, stop_token_ids=set(), min_new_tokens=self.new_tokens,
                               batch_size=len(batch))  # the cell's batch, whatever the run's batch_size
        gen = gens[0]
        total = gen.prefill_seconds * len(batch) + gen.decode_seconds * len(batch)
        kept = [n for layer in gen.kept_per_layer_head for n in layer]
        timings = {
            "ttft_seconds": gen.prefill_seconds * len(batch),  # per-row shares -> the batch's wall time
            "tpot_seconds": gen.tpot_seconds,
            "first_step_seconds": gen.first_step_seconds,
            "tpot_after_first_seconds": gen.tpot_after_first_seconds,
            "peak_memory_bytes": gen.peak_memory_bytes,
            "peak_memory_above_weights_bytes": gen.peak_memory_above_weights_bytes,
            "throughput_tokens_per_second": len(batch) * self.new_tokens / total,
            "decode_tokens_per_second": len(batch) / gen.tpot_seconds,
            **self._bound(engine.model, len(batch), sum(g.decode_kv_bytes_mean for g in gens), gen.tpot_seconds),
        }
        if not detail:
            return timings
        return {
            **timings,
            "n_keep": gen.n_keep,
            "kv_bytes_full": gen.kv_bytes_full * len(batch),
            "kv_bytes_compressed": gen.kv_bytes_compressed * len(batch),
            "kept_mean": sum(kept) / len(kept),
            "compress_seconds": gen.compress_seconds * len(batch),
        }

    def _time_bare(self, model, batch: list[list[int]], kv_bytes_read: float) -> dict:
        """One ``model.generate`` call, each token's logits timestamped as they are ready: TTFT = the first
        stamp, TPOT = the mean gap between stamps (one call: no difference of two noisy timings)."""
        ids = torch.tensor(batch, device=next(model.parameters()).device)
        device = ids.device
        clock = StepClock(device)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        with PeakMemory(device, baseline=weights) as peak:
            _sync(device)
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(ids, max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids),
                               logits_processor=LogitsProcessorList([clock]))
            _sync(device)
            total = time.perf_counter() - start
        times = clock.times
        tpot = (times[-1] - times[0]) / (len(times) - 1)
        return {
            "ttft_seconds": times[0] - start,
            "tpot_seconds": tpot,
            "first_step_seconds": times[1] - times[0],
            "tpot_after_first_seconds": (times[-1] - times[1]) / (len(times) - 2) if len(times) > 2 else math.nan,
            "peak_memory_bytes": peak.bytes,
            "peak_memory_above_weights_bytes": peak.bytes - weights,
            "throughput_tokens_per_second": len(batch) * self.new_tokens / total,
            "decode_tokens_per_second": len(batch) / tpot,
            **self._bound(model, len(batch), kv_bytes_read, tpot),
        }

    # -- the bytes-read bound ---------------------------------------------------------------------------

    def _memory_bandwidth(self, device: torch.device) -> float:
        """Bytes per second: the configured value, else a copy measured on first use."""
        if self._bandwidth is None:
            self._bandwidth = self.memory_bandwidth_gbps * 1e9 if self.memory_bandwidth_gbps else copy_bandwidth(device)
        return self._bandwidth

    def _bound(self, model, batch: int, kv_bytes_read: float, tpot: float) -> dict:
        bandwidth = self._memory_bandwidth(next(model.parameters()).device)
        params = parameter_bytes_read(model, batch)
        bound = tpot_bound_seconds(params, kv_bytes_read, bandwidth)
        return {"parameter_bytes_read_per_step": params, "kv_bytes_read_per_step": kv_bytes_read,
                "memory_bandwidth_gbps": bandwidth / 1e9, "tpot_bound_seconds": bound,
                "bound_fraction": bound / tpot if tpot else float("nan")}

    # -- throughput -------------------------------------------------------------------------------------

    def _throughput_cell(self, sample: Sample, prompt: list[int], engine: Engine, full: Engine) -> list[dict]:
        device = engine.device
        if device.type not in ("cuda", "cpu"):
            raise ConfigError(f"efficiency.measure=throughput runs on cuda or cpu, not on '{device.type}'")
        cap = int(self.memory_cap_gib * GIB) if self.memory_cap_gib else free_memory_bytes(device)
        base = {"dataset": sample.meta["dataset"], "prompt_length": len(prompt), "output_tokens": self.new_tokens,
                "memory_cap_bytes": cap}
        rows = []
        for system, system_engine in (("method", engine), ("full", full)):
            if system == "full" and isinstance(engine.method, Full):  # the method is the full cache: same search
                rows += [{**row, "system": "full", "sample_id": row["sample_id"].replace("-method-", "-full-")}
                         for row in rows]
                continue
            for _ in range(self.warmup):  # in this process, uncapped: forked children inherit what it warmed
                system_engine.generate([prompt], self.new_tokens, stop_token_ids=set(), min_new_tokens=self.new_tokens)
            system_rows: list[dict] = []

            def attempt(batch: int, phase: str) -> float | None:
                row = self._try(system_engine, prompt, batch, cap, detail=system == "method")
                system_rows.append({"sample_id": f"{sample.id}-{system}-{len(system_rows)}", "system": system,
                                    "phase": phase, "batch_size": batch, **base, **row})
                return row["peak_memory_bytes"] if row["fits"] else None

            fitted, _ = largest_batch(lambda b: attempt(b, "search"), self.batch_start, self.batch_growth,
                                      self.batch_precision, self.max_batch, memory_limit(device, cap))
            for _ in range(self.repeats - 1 if fitted else 0):
                attempt(fitted, "repeat")
            rows += system_rows
        return rows

    def _try(self, engine: Engine, prompt: list[int], batch: int, cap: int, detail: bool) -> dict:
        """One ``engine.generate`` of ``batch`` copies of the prompt under the memory cap: its timings, or
        ``fits`` false and the out-of-memory message."""
        with MemoryCap(engine.device, cap) as capped:
            result = capped.run(lambda: self._time_engine(engine, [prompt] * batch, detail))
        return {"fits": True, "error": "", **result} if isinstance(result, dict) else {"fits": False, "error": result}

    # -- metrics ----------------------------------------------------------------------------------------

    def aggregate(self, predictions: pd.DataFrame) -> list[dict]:
        metrics = throughput_metrics if self.measure == "throughput" else latency_metrics
        return [{**row, "mode": NO_QUERY} for dataset, cell in predictions.groupby("dataset", sort=True)
                for row in metrics(dataset, cell)]


class StepClock(LogitsProcessor):
    """Stamps the time at which each new token's logits are ready (after a device sync)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        _sync(self.device)
        self.times.append(time.perf_counter())
        return scores


def latency_metrics(dataset: str, cell: pd.DataFrame) -> list[dict]:
    """Median over repeats of each measure per system, the bound fraction of the medians, and the method's
    ratios to full and bare (and full's to bare: the harness overhead), all from one run's measurements."""
    med = {(system, m): statistics.median(cell.loc[cell.system == system, m])
           for system in SYSTEMS for m in MEASURES if m in cell}
    rows = []
    for system in SYSTEMS:
        n = int((cell.system == system).sum())
        values = {m: med[(system, m)] for m in MEASURES if (system, m) in med}
        values["bound_fraction"] = _ratio(values.get("tpot_bound_seconds"), values["tpot_seconds"])
        rows += [{"dataset": dataset, "metric": f"{system}.{m}", "value": v, "n": n} for m, v in values.items()]
    for num, den in (("method", "full"), ("method", "bare"), ("full", "bare")):
        for m in MEASURES:
            if (num, m) in med:
                rows.append({"dataset": dataset, "metric": f"ratio.{num}_vs_{den}.{m}",
                             "value": _ratio(med[(num, m)], med[(den, m)]), "n": int((cell.system == num).sum())})
    return rows + _bandwidth_metric(dataset, cell)


def throughput_metrics(dataset: str, cell: pd.DataFrame) -> list[dict]:
    """Per system: the largest batch that fitted in the search, the smallest that failed (NaN if none did up
    to max_batch), the median of each measure over the tries at the largest batch and the bound fraction;
    then the method's ratios to the full cache."""
    values = {}
    for system in ("method", "full"):
        tries = cell[cell.system == system]
        search = tries[tries.phase == "search"]
        fitted, failed = search.loc[search.fits, "batch_size"], search.loc[~search.fits, "batch_size"]
        best = int(fitted.max()) if len(fitted) else 0
        at_best = tries[tries.fits & (tries.batch_size == best)]
        values[system] = {"max_batch": best, "failed_batch": float(failed.min()) if len(failed) else float("nan"),
                          "search_tries": len(search), "memory_cap_bytes": float(cell["memory_cap_bytes"].iloc[0])}
        for m in (m for m in MEASURES if m in tries):  # rows written before a measure existed lack it
            values[system][m] = statistics.median(at_best[m]) if len(at_best) else float("nan")
        values[system]["bound_fraction"] = _ratio(values[system]["tpot_bound_seconds"], values[system]["tpot_seconds"])
    rows = [{"dataset": dataset, "metric": f"{system}.{m}", "value": float(v), "n": values[system]["search_tries"]}
            for system in values for m, v in values[system].items()]
    rows += [{"dataset": dataset, "metric": f"ratio.method_vs_full.{m}",
              "value": _ratio(values["method"][m], values["full"][m]), "n": values["method"]["search_tries"]}
             for m in THROUGHPUT_RATIOS]
    return rows + _bandwidth_metric(dataset, cell)


def _bandwidth_metric(dataset: str, cell: pd.DataFrame) -> list[dict]:
    bandwidth = cell["memory_bandwidth_gbps"].dropna() if "memory_bandwidth_gbps" in cell else []
    return [{"dataset": dataset, "metric": "memory_bandwidth_gbps", "value": float(bandwidth.iloc[0]), "n": 1}
            ] if len(bandwidth) else []


def _ratio(num, den) -> float:
    return num / den if num is not None and den and den == den else float("nan")


def largest_batch(try_batch: Callable[[int], float | None], start: int, growth: float, precision: float,
                  max_batch: int, memory_limit: float | None = None) -> tuple[int, int | None]:
    """(largest batch that fitted or 0, smallest that failed or None). ``try_batch(b)`` is one real try: its
    peak memory, or None when it ran out of memory.

    Grows from ``start`` by ``growth`` until a batch fails or ``max_batch`` fits, then bisects until
    failed - fitted <= max(1, precision * fitted). With ``memory_limit`` (bytes), the line through the last two
    fitting tries' peaks predicts the largest batch under it, and a growth step never goes past that
    prediction (but always grows by one): where memory is linear in the batch (static per-row storage) the
    search ends with a try at the prediction and one above it, instead of bisecting between long tries.
    """
    fitted, failed, batch = 0, None, start
    peaks: dict[int, float] = {}
    while failed is None:
        peak = try_batch(batch)
        if peak is None:
            failed = batch
        elif batch == max_batch:
            return batch, None
        else:
            fitted, peaks[batch] = batch, peak
            step = max(batch + 1, int(batch * growth))
            predicted = _predicted_batch(peaks, memory_limit)
            batch = min(max_batch, step if predicted is None else max(batch + 1, min(step, predicted)))
    while failed - fitted > max(1, precision * fitted):
        middle = (fitted + failed) // 2
        if try_batch(middle) is None:
            failed = middle
        else:
            fitted = middle
    return fitted, failed


def _predicted_batch(peaks: dict[int, float], memory_limit: float | None) -> int | None:
    """The largest batch whose peak stays under the limit on the line through the last two fitting tries."""
    if memory_limit is None or len(peaks) < 2:
        return None
    (b1, p1), (b2, p2) = sorted(peaks.items())[-2:]
    per_row = (p2 - p1) / (b2 - b1)
    return b2 + int((memory_limit - p2) // per_row) if per_row > 0 else None
