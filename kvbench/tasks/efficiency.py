"""Efficiency benchmark in the style of Chelsea Table 3: TTFT, TPOT, peak memory and throughput.

Synthetic prompts of configured lengths (random token ids: speed does not depend on content), a fixed
number of new tokens with EOS disabled, warm-up and repeats, several batch sizes. In the same process and
run it times three systems on identical prompts, so ratios are measured in one run:
  ``method``  the configured method through kvbench's engine,
  ``full``    the full cache through kvbench's engine (the ratio denominators),
  ``bare``    plain ``model.generate`` with the model's own cache (harness overhead = full / bare).
Per-sample rows hold every repeat's numbers; ``aggregate`` reports medians and the ratios.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import ClassVar

import pandas as pd
import torch

from kvbench.budget import Budget
from kvbench.engine import Engine, _sync
from kvbench.errors import ConfigError
from kvbench.memory import PeakMemory
from kvbench.methods.full import Full
from kvbench.tasks.base import NO_QUERY, Prompt, Sample, Task

SYSTEMS = ("method", "full", "bare")
MEASURES = ("ttft_seconds", "tpot_seconds", "peak_memory_bytes", "throughput_tokens_per_second")


@dataclass
class Efficiency(Task):
    name: ClassVar[str] = "efficiency"
    context_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    new_tokens: int = 32
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    warmup: int = 1
    repeats: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.new_tokens < 2:
            raise ConfigError(f"efficiency.new_tokens={self.new_tokens} must be >= 2 (TPOT needs two tokens)")
        for name in ("context_lengths", "batch_sizes"):
            bad = [v for v in getattr(self, name) if v < 1]
            if bad or not getattr(self, name):
                raise ConfigError(f"efficiency.{name}={list(getattr(self, name))} must be non-empty positive ints")
        if self.repeats < 1 or self.warmup < 0:
            raise ConfigError(f"efficiency: repeats={self.repeats} must be >= 1 and warmup={self.warmup} >= 0")

    def samples(self) -> list[Sample]:
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
        full = Engine(engine.model, Full(), Budget("fraction", 1.0), engine.attn_implementation,
                      engine.position_mode)
        rows = []
        for sample in samples:
            prompt = self.build_prompt(sample, lm).context_ids
            batch = [prompt] * sample.meta["batch_size"]
            for system in SYSTEMS:
                run = {"method": lambda: self._time_engine(engine, batch, detail=True),
                       "full": lambda: self._time_engine(full, batch, detail=False),
                       "bare": lambda: self._time_bare(engine.model, batch)}[system]
                for _ in range(self.warmup):
                    run()
                for repeat in range(self.repeats):
                    rows.append({"sample_id": f"{sample.id}-{system}-{repeat}", "dataset": sample.meta["dataset"],
                                 "mode": NO_QUERY, "system": system, "repeat": repeat, "prompt_length": len(prompt),
                                 "batch_size": len(batch), "output_tokens": self.new_tokens, **run()})
        return rows

    def _time_engine(self, engine: Engine, batch: list[list[int]], detail: bool) -> dict:
        """Timings of one engine call; ``detail`` adds the realized budget (the method's rows only, so that
        run-level budget columns describe the configured method, not the full-cache reference)."""
        gens = engine.generate(batch, self.new_tokens, stop_token_ids=set(), min_new_tokens=self.new_tokens)
        gen = gens[0]
        total = gen.prefill_seconds * len(batch) + gen.decode_seconds * len(batch)
        kept = [n for layer in gen.kept_per_layer_head for n in layer]
        timings = {
            "ttft_seconds": gen.prefill_seconds * len(batch),  # per-row shares -> the batch's wall time
            "tpot_seconds": gen.tpot_seconds,
            "peak_memory_bytes": gen.peak_memory_bytes,
            "throughput_tokens_per_second": len(batch) * self.new_tokens / total,
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

    def _time_bare(self, model, batch: list[list[int]]) -> dict:
        """``model.generate`` timed twice: 1 token (TTFT) and all tokens; TPOT from the difference."""
        ids = torch.tensor(batch, device=next(model.parameters()).device)
        device = ids.device

        def timed(n: int) -> float:
            _sync(device)
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                               pad_token_id=0, attention_mask=torch.ones_like(ids))
            _sync(device)
            return time.perf_counter() - start

        ttft = timed(1)
        with PeakMemory(device) as peak:
            total = timed(self.new_tokens)
        return {
            "ttft_seconds": ttft,
            "tpot_seconds": max(total - ttft, 0.0) / (self.new_tokens - 1),
            "peak_memory_bytes": peak.bytes,
            "throughput_tokens_per_second": len(batch) * self.new_tokens / total,
        }

    def aggregate(self, predictions: pd.DataFrame) -> list[dict]:
        """Median over repeats of each measure per cell and system, and the method's ratios to full and bare
        (and full's to bare: the harness overhead), all from this run's own measurements."""
        rows = []
        for dataset, cell in predictions.groupby("dataset", sort=True):
            med = {(system, m): statistics.median(cell.loc[cell.system == system, m])
                   for system in SYSTEMS for m in MEASURES}
            for system in SYSTEMS:
                for m in MEASURES:
                    rows.append({"dataset": dataset, "metric": f"{system}.{m}", "value": med[(system, m)],
                                 "n": int((cell.system == system).sum()), "mode": NO_QUERY})
            for num, den in (("method", "full"), ("method", "bare"), ("full", "bare")):
                for m in MEASURES:
                    value = med[(num, m)] / med[(den, m)] if med[(den, m)] else float("nan")
                    rows.append({"dataset": dataset, "metric": f"ratio.{num}_vs_{den}.{m}", "value": value,
                                 "n": int((cell.system == num).sum()), "mode": NO_QUERY})
        return rows
