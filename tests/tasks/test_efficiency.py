"""The efficiency task: the bytes-read bound (by hand), the batch search, the memory cap with real
out-of-memory errors, and throughput mode end to end on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.errors import ConfigError
from kvbench.hardware import MemoryCap, parameter_bytes_read, tpot_bound_seconds
from kvbench.memory import PeakMemory
from kvbench.methods.full import Full
from kvbench.methods.streamingllm import StreamingLLM
from kvbench.tasks.base import Sample
from kvbench.tasks.efficiency import Efficiency, largest_batch, throughput_metrics
from tests.conftest import pythonpath_with_repo

# tiny-llama-random: 2 layers, 2 key/value heads of width 16, float32 -> one slot of K+V in one head = 128 bytes
SLOT_BYTES, LAYERS, KV_HEADS = 2 * 16 * 4, 2, 2


def test_decode_kv_bytes_mean_counts_the_slots_each_step_reads(tiny_model):
    # full cache, prompts of 10 and 6 tokens, 3 new tokens = 2 decode steps reading n+1 then n+2 slots per head
    gens = Engine(tiny_model, Full(), Budget("fraction", 1.0)).generate(
        [list(range(1, 11)), list(range(1, 7))], 3, set(), min_new_tokens=3)
    per_slot_all_heads = SLOT_BYTES * LAYERS * KV_HEADS
    assert gens[0].decode_kv_bytes_mean == (11 + 12) / 2 * per_slot_all_heads
    assert gens[1].decode_kv_bytes_mean == (7 + 8) / 2 * per_slot_all_heads
    # StreamingLLM keeps 8 slots: every step reads those 8 and its own new slot, then evicts back to 8
    gen = Engine(tiny_model, StreamingLLM(), Budget("tokens", 8)).generate([list(range(1, 11))], 4, set(),
                                                                           min_new_tokens=4)[0]
    assert gen.decode_kv_bytes_mean == 9 * per_slot_all_heads


def tiny_llama(tied: bool) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


def test_parameter_bytes_read_by_hand():
    # one layer: q 4x4 + k 4x2 + v 4x2 + o 4x4 + gate/up/down 3 x 6x4 + two norms of 4 = 128; final norm 4;
    # embedding and LM head 10x4 each; float32
    untied = tiny_llama(tied=False)
    # untied: the LM head is read whole (40), the embedding only at the batch's 3 looked-up rows (3 x 4)
    assert parameter_bytes_read(untied, batch=3) == 4 * (128 + 4 + 40 + 3 * 4)
    # tied: one 10x4 matrix, read whole by the LM head, whatever the batch
    assert parameter_bytes_read(tiny_llama(tied=True), batch=3) == 4 * (128 + 4 + 40)
    assert tpot_bound_seconds(736, 264, bandwidth=1000.0) == pytest.approx(1.0)


def test_latency_rows_carry_the_bound_by_hand(tiny_lm):
    task = Efficiency(context_lengths=[10], new_tokens=3, warmup=0, repeats=1, memory_bandwidth_gbps=2e-6)
    rows = task.predict(task.samples(), tiny_lm, Engine(tiny_lm.model, Full(), Budget("fraction", 1.0)))
    vocab = tiny_lm.model.config.vocab_size
    # 2 layers of 36,992 weights (q, k, v, o, gate, up, down, 2 norms), final norm 64, LM head vocab x 64, and
    # one looked-up embedding row of 64; float32
    params = 4 * (2 * 36_992 + 64 + vocab * 64 + 64)
    kv = (11 + 12) / 2 * SLOT_BYTES * LAYERS * KV_HEADS
    for row in rows:  # method, full and bare (plain generate holds the same uncompressed cache)
        assert row["parameter_bytes_read_per_step"] == params and row["kv_bytes_read_per_step"] == kv
        assert row["tpot_bound_seconds"] == pytest.approx((params + kv) / 2000.0)
        assert row["bound_fraction"] == pytest.approx(row["tpot_bound_seconds"] / row["tpot_seconds"])
        # 3 new tokens: 2 decode steps, the first and the one after it make the TPOT
        assert row["first_step_seconds"] > 0 and row["tpot_after_first_seconds"] > 0
        assert row["first_step_seconds"] + row["tpot_after_first_seconds"] == pytest.approx(2 * row["tpot_seconds"])
    metrics = {r["metric"]: r["value"] for r in task.aggregate(pd.DataFrame(rows))}
    assert metrics["full.tpot_bound_seconds"] == pytest.approx((params + kv) / 2000.0)
    after_first = [r["tpot_after_first_seconds"] for r in rows if r["system"] in ("method", "full")]
    assert metrics["ratio.method_vs_full.tpot_after_first_seconds"] == pytest.approx(after_first[0] / after_first[1])
    assert metrics["memory_bandwidth_gbps"] == pytest.approx(2e-6)


def test_cpu_peak_memory_counts_live_tensor_bytes():
    with PeakMemory(torch.device("cpu"), baseline=100) as peak:
        first = torch.empty(1000, dtype=torch.uint8)
        del first  # freed before the larger one: the allocator may reuse it, the count still drops
        second = torch.empty(3000, dtype=torch.float32)
    assert peak.bytes == 100 + second.nbytes


def test_cpu_peak_records_allocations_only_and_agrees_with_the_public_profiler(tiny_model, monkeypatch):
    """The allocations-only profiler sees no operator, and its peak is the one the public profiler (operators
    and allocations, the fallback where torch lacks the private API) finds for the same work."""
    from kvbench import memory

    ids = torch.randint(3, tiny_model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))

    def work():
        with torch.no_grad():
            tiny_model(ids)

    work()  # first-call allocations (lazy buffers) out of the way
    with PeakMemory(torch.device("cpu")) as fast:
        work()
    assert fast._profiler is None  # released after the block
    seen = []
    monkeypatch.setattr(memory._AllocationsProfiler, "events",
                        lambda self: seen.extend(e.name() for e in self.result.events()) or self.result.events())
    with PeakMemory(torch.device("cpu")) as again:
        work()
    # on a CUDA host the trace also holds CUDA runtime calls (cudaStreamIsCapturing), which are not operators
    assert {name for name in seen if not name.startswith("cuda")} == {memory.MEMORY_RECORD}
    assert again.bytes == fast.bytes > 0

    def missing(self):
        raise AttributeError("no private profiler API")

    monkeypatch.setattr(memory._AllocationsProfiler, "__enter__", missing)
    with PeakMemory(torch.device("cpu")) as public:
        work()
    assert public.bytes == fast.bytes


def test_plain_generate_cpu_peak_holds_at_least_its_kv_cache(tiny_lm):
    n, new = 1000, 3
    task = Efficiency(context_lengths=[n], new_tokens=new, warmup=1, repeats=1, memory_bandwidth_gbps=1.0)
    rows = task.predict(task.samples(), tiny_lm, Engine(tiny_lm.model, Full(), Budget("fraction", 1.0)))
    cache = (n + new - 1) * SLOT_BYTES * LAYERS * KV_HEADS  # every token but the last one's K+V
    weights = sum(p.numel() * p.element_size() for p in tiny_lm.model.parameters())
    for row in rows:  # plain generate and kvbench's full cache hold the same uncompressed cache
        assert row["peak_memory_above_weights_bytes"] >= cache, row["system"]
        assert row["peak_memory_bytes"] == weights + row["peak_memory_above_weights_bytes"]


def replay(outcome, **search) -> tuple[list[int], tuple]:
    """The search over ``outcome(batch)`` (a peak in bytes, or None for out of memory); the batches tried."""
    tried = []

    def try_batch(batch: int) -> float | None:
        tried.append(batch)
        return outcome(batch)

    return tried, largest_batch(try_batch, **search)


def fits_up_to(threshold: int, peak=lambda b: 1.0):
    return lambda b: peak(b) if b <= threshold else None


SEARCH = dict(start=1, growth=2, precision=0, max_batch=4096)


@pytest.mark.parametrize("threshold,search,tried,result", [
    (13, SEARCH, [1, 2, 4, 8, 16, 12, 14, 13], (13, 14)),
    (13, {**SEARCH, "precision": 0.25}, [1, 2, 4, 8, 16, 12, 14], (12, 14)),
    (5, {**SEARCH, "start": 32}, [32, 16, 8, 4, 6, 5], (5, 6)),
    (100, {**SEARCH, "max_batch": 10}, [1, 2, 4, 8, 10], (10, None)),
    (0, SEARCH, [1], (0, 1)),
    (9, {**SEARCH, "growth": 1.5}, [1, 2, 3, 4, 6, 9, 13, 11, 10], (9, 10)),
])
def test_search_grows_geometrically_then_bisects(threshold, search, tried, result):
    assert replay(fits_up_to(threshold), **search) == (tried, result)


def linear_peak(b):  # bytes: 10 fixed + 3 per row; a 100-byte limit fits 30 rows
    return 10.0 + 3 * b


@pytest.mark.parametrize("threshold,tried,result", [
    (30, [1, 2, 4, 8, 16, 30, 31], (30, 31)),  # the line is right: the prediction, then one above it
    (27, [1, 2, 4, 8, 16, 30, 23, 26, 28, 27], (27, 28)),  # optimistic (fragmentation): bisection takes over
    (33, [1, 2, 4, 8, 16, 30, 31, 32, 33, 34], (33, 34)),  # pessimistic: growth by one past the prediction
])
def test_search_steps_no_further_than_the_memory_line_predicts(threshold, tried, result):
    assert replay(fits_up_to(threshold, linear_peak), **SEARCH, memory_limit=100.0) == (tried, result)


def test_memory_cap_returns_a_real_cpu_out_of_memory_and_raises_other_errors():
    cpu = torch.device("cpu")
    with MemoryCap(cpu, 2**24) as capped:  # 16 MiB beyond the process's address space
        message = capped.run(lambda: {"n": float(torch.ones(2**30).sum())})  # 4 GiB
        assert isinstance(message, str) and "memory" in message
        assert capped.run(lambda: {"n": float(torch.ones(2**10).sum())}) == {"n": 1024.0}
        with pytest.raises(RuntimeError, match="ValueError: not a memory error"):
            capped.run(lambda: (_ for _ in ()).throw(ValueError("not a memory error")))


def test_bad_settings_name_the_value_and_what_is_accepted():
    with pytest.raises(ConfigError, match="measure='speed'.*latency, throughput"):
        Efficiency(measure="speed")
    with pytest.raises(ConfigError, match="memory_cap_gib=-1"):
        Efficiency(memory_cap_gib=-1)
    with pytest.raises(ConfigError, match="batch_growth=1"):
        Efficiency(batch_growth=1)


def test_throughput_metrics_by_hand():
    def row(system, phase, batch, fits, tpot=float("nan"), bound=float("nan")):
        return {"system": system, "phase": phase, "batch_size": batch, "fits": fits, "tpot_seconds": tpot,
                "tpot_bound_seconds": bound, "memory_cap_bytes": 100, "memory_bandwidth_gbps": 2.0,
                **{m: batch * 10.0 if fits else float("nan") for m in ("ttft_seconds", "peak_memory_bytes",
                                                                        "peak_memory_above_weights_bytes",
                                                                        "throughput_tokens_per_second")},
                "decode_tokens_per_second": batch / tpot if fits else float("nan")}

    cell = pd.DataFrame([
        row("method", "search", 1, True, 0.1, 0.05), row("method", "search", 2, True, 0.1, 0.05),
        row("method", "search", 4, False), row("method", "search", 3, True, 0.2, 0.1),
        row("method", "repeat", 3, True, 0.4, 0.1), row("method", "repeat", 3, True, 0.3, 0.1),
        row("full", "search", 1, True, 0.1, 0.08), row("full", "search", 2, False),
    ])
    m = {r["metric"]: r["value"] for r in throughput_metrics("len8_throughput", cell)}
    assert (m["method.max_batch"], m["method.failed_batch"], m["method.search_tries"]) == (3, 4, 4)
    assert (m["full.max_batch"], m["full.failed_batch"]) == (1, 2)
    assert m["method.tpot_seconds"] == pytest.approx(0.3)  # median of the three tries at batch 3
    assert m["method.decode_tokens_per_second"] == pytest.approx(10.0)  # median of 3/0.2, 3/0.4, 3/0.3
    assert m["method.bound_fraction"] == pytest.approx(0.1 / 0.3)
    assert m["ratio.method_vs_full.max_batch"] == 3.0
    assert m["ratio.method_vs_full.decode_tokens_per_second"] == pytest.approx(10.0 / 10.0)
    assert m["memory_bandwidth_gbps"] == 2.0


def run_throughput(tmp_path, model: str, context: int, cap_gib: float) -> tuple[pd.DataFrame, dict]:
    """An ordinary kvbench run in a fresh process (the cap is relative to what that process holds)."""
    root = tmp_path / "results"
    args = [sys.executable, "-m", "kvbench", f"model={model}", "method=streamingllm", "budget=0.2",
            "task=efficiency", "task.measure=throughput", f"task.context_lengths=[{context}]", "task.new_tokens=2",
            f"task.memory_cap_gib={cap_gib}", "task.memory_bandwidth_gbps=10", "task.warmup=1", "task.repeats=2",
            f"results_root={root}", f"hydra.run.dir={tmp_path / 'hydra'}"]
    env = {**os.environ, "PYTHONPATH": pythonpath_with_repo()}
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    tries = pd.read_parquet(root / "predictions.parquet")
    metrics = pd.read_parquet(root / "metrics.parquet")
    return tries, dict(zip(metrics["metric"], metrics["value"]))


def check_throughput_run(tries: pd.DataFrame, metrics: dict, cap_gib: float) -> None:
    assert (tries["memory_cap_bytes"] == int(cap_gib * 2**30)).all()
    for system in ("method", "full"):
        mine = tries[tries.system == system]
        search = mine[mine.phase == "search"]
        # the recorded tries are exactly the search's sequence for the recorded outcomes
        outcomes = dict(zip(search.batch_size, search.fits))
        seen, (fitted, failed) = replay(lambda b: 1.0 if outcomes[b] else None, **SEARCH)
        assert seen == search.batch_size.tolist()
        # a real out-of-memory, recorded as a result: the batch just above the largest that fitted
        assert fitted >= 1 and failed == fitted + 1
        errors = search.loc[~search.fits, "error"]
        assert len(errors) and errors.str.contains("memory", case=False).all()
        assert mine[mine.phase == "repeat"].batch_size.tolist() == [fitted]
        assert metrics[f"{system}.max_batch"] == fitted and metrics[f"{system}.failed_batch"] == failed
        at_max = mine[mine.fits & (mine.batch_size == fitted)]
        assert metrics[f"{system}.tpot_seconds"] == pytest.approx(at_max.tpot_seconds.median())
        assert metrics[f"{system}.bound_fraction"] == pytest.approx(
            metrics[f"{system}.tpot_bound_seconds"] / metrics[f"{system}.tpot_seconds"])
    assert metrics["ratio.method_vs_full.max_batch"] == metrics["method.max_batch"] / metrics["full.max_batch"]


def test_throughput_mode_searches_batches_until_a_real_out_of_memory_on_cpu(tmp_path):
    # the tiny model, not SmolLM2: SmolLM2 needs ~35 s of CPU for the same search (the slow test below);
    # 2,048-token rows make a batch's memory grow fast while its compute stays small
    tries, metrics = run_throughput(tmp_path, "tiny-llama-random", 2048, 0.02)
    check_throughput_run(tries, metrics, 0.02)


@pytest.mark.slow
def test_throughput_mode_on_smollm2(tmp_path):
    tries, metrics = run_throughput(tmp_path, "smollm2-135m-instruct", 16, 0.02)
    check_throughput_run(tries, metrics, 0.02)


def test_throughput_cell_with_the_full_cache_as_method_searches_once(tiny_lm, monkeypatch):
    task = Efficiency(measure="throughput", context_lengths=[8], new_tokens=2, warmup=0, repeats=1,
                      memory_bandwidth_gbps=1.0, memory_cap_gib=1.0, max_batch=2)
    calls = []
    monkeypatch.setattr(Efficiency, "_try", lambda self, engine, prompt, batch, cap, detail: calls.append(batch)
                        or {"fits": True, "error": "", "tpot_seconds": 1.0, "peak_memory_bytes": 1})
    rows = task.predict([Sample(id="len8-throughput", context="", meta={"dataset": "len8_throughput",
                                                                         "context_length": 8})],
                        tiny_lm, Engine(tiny_lm.model, Full(), Budget("fraction", 1.0)))
    assert calls == [1, 2]
    assert [r["system"] for r in rows] == ["method", "method", "full", "full"]
