"""Efficiency in the report, on a results root written through ``kvbench.store`` with the task's own
aggregation: latency at two context lengths (lines, bound drawn), latency at one length (bars), throughput
(its own table, tokens/s vs batch); the full cache as the median of the runs' same-run references."""

from __future__ import annotations

import pandas as pd
import pytest

from kvbench import store
from kvbench.report import data, efficiency, main
from kvbench.tasks.efficiency import Efficiency

LONG, SHORT = "llama3.1-8b-shape-random", "tiny-llama-random"
MEASURES = ("ttft_seconds", "peak_memory_bytes", "peak_memory_above_weights_bytes", "throughput_tokens_per_second")


def latency_rows(lengths, method_tpot: float, full_tpot: float) -> list[dict]:
    rows = []
    for n in lengths:
        for system, tpot in (("method", method_tpot), ("full", full_tpot), ("bare", full_tpot)):
            rows.append({"sample_id": f"len{n}-bs1-{system}-0", "dataset": f"len{n}_bs1", "system": system,
                         "batch_size": 1, "prompt_length": n, "tpot_seconds": tpot * n / 1024,
                         "tpot_bound_seconds": tpot * n / 2048, "decode_tokens_per_second": 1024 / (tpot * n),
                         "memory_bandwidth_gbps": 3000.0, **{m: float(n) for m in MEASURES}})
    return rows


def throughput_rows(method_max: int, full_max: int) -> list[dict]:
    rows = []
    for system, largest in (("method", method_max), ("full", full_max)):
        batch = 1
        while batch <= largest:
            rows.append(try_row(system, batch, True))
            batch *= 2
        rows.append(try_row(system, batch, False))
    return rows


def try_row(system: str, batch: int, fits: bool) -> dict:
    tpot = 0.02 + 0.001 * batch
    return {"sample_id": f"{system}-{batch}", "dataset": "len16384_throughput", "system": system, "phase": "search",
            "batch_size": batch, "prompt_length": 16384, "fits": fits, "error": "" if fits else "CUDA out of memory",
            "memory_cap_bytes": 2**36, "memory_bandwidth_gbps": 3000.0,
            **({"tpot_seconds": tpot, "tpot_bound_seconds": 0.8 * tpot, "decode_tokens_per_second": batch / tpot,
                **{m: float(batch) for m in MEASURES}} if fits else {})}


def write(root, model, method, mode, predictions) -> None:
    task = Efficiency(measure=mode)
    rid = store.run_id({"model": model, "method": method, "mode": mode})
    run = {"run_id": rid, "model": model, "method": method, "budget": "0.2", "budget_kind": "fraction",
           "budget_value": 0.2, "task": "efficiency", "task.measure": mode, "seed": 42, "position_mode": "original"}
    predictions = pd.DataFrame(predictions)
    predictions.insert(0, "run_id", rid)
    metrics = pd.DataFrame([{**run, **row} for row in task.aggregate(predictions)])
    store.write_run(root, rid, "{}", predictions, metrics, {"run_id": rid})


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("efficiency")
    write(root, LONG, "snapkv", "latency", latency_rows([1024, 2048], method_tpot=0.010, full_tpot=0.010))
    write(root, LONG, "h2o", "latency", latency_rows([1024, 2048], method_tpot=0.030, full_tpot=0.014))
    write(root, LONG, "snapkv", "throughput", throughput_rows(method_max=16, full_max=4))
    write(root, LONG, "full", "throughput", throughput_rows(method_max=4, full_max=4))
    write(root, SHORT, "snapkv", "latency", latency_rows([64], method_tpot=0.002, full_tpot=0.003))
    store.collect(root)
    drawn = []
    original = efficiency._bars
    efficiency._bars = lambda frame, methods: drawn.append(frame["model"].iloc[0]) or original(frame, methods)
    try:
        assert main(["--root", str(root), "--no-paper"]) == 0
    finally:
        efficiency._bars = original
    return root / "report", drawn


def test_latency_table_shows_the_bound_and_throughput_has_its_own_table(report):
    out, _ = report
    def table(name):
        frame = pd.read_csv(out / "tables" / f"{name}.csv", dtype={"budget": str})
        return frame[frame["model"] == LONG].set_index(["budget", "method"])

    latency = table("efficiency")
    assert sorted(latency.index) == [("0.2", "h2o"), ("0.2", "snapkv")]  # no [mode=...] variant rows
    assert latency.at[("0.2", "h2o"), "len2048_bs1/method.tpot_bound_seconds"] == pytest.approx(0.030)
    assert latency.at[("0.2", "h2o"), "len2048_bs1/method.bound_fraction"] == pytest.approx(0.5)
    throughput = table("efficiency_throughput")
    assert throughput.at[("0.2", "snapkv"), "len16384_throughput/method.max_batch"] == 16
    assert throughput.at[("0.2", "snapkv"), "len16384_throughput/ratio.method_vs_full.max_batch"] == 4
    assert throughput.at[("full", "full"), "len16384_throughput/method.bound_fraction"] == pytest.approx(0.8)
    text = (out / "report.md").read_text()
    assert "## efficiency_throughput" in text and "method.tpot_bound_seconds (ms)" in text


def test_full_cache_is_the_median_of_the_runs_same_run_references(report):
    out, _ = report
    metrics = data.label_rows(efficiency.table_per_measure(pd.read_parquet(out.parent / "metrics.parquet")))
    points = efficiency.cell_points(metrics).set_index(["task", "model", "row_method", "batch", "context_length"])
    full = points.loc[("efficiency", LONG, "full", "batch 1", 1024.0)]
    assert full["tpot_seconds"] == pytest.approx((0.010 + 0.014) / 2)
    assert full["budget"] == "full"
    largest = points.loc[("efficiency_throughput", LONG, "snapkv", efficiency.LARGEST, 16384.0)]
    assert largest["max_batch"] == 16 and largest["tpot_seconds"] == pytest.approx(0.036)
    # the method=full run is a reference like the others, not a line of its own
    assert points.loc[("efficiency_throughput", LONG, "full", efficiency.LARGEST, 16384.0), "max_batch"] == 4


@pytest.mark.parametrize("name", [
    f"efficiency_efficiency_{LONG}_0.2_batch1",  # two lengths: lines with the bound
    f"efficiency_efficiency_{SHORT}_0.2_batch1",  # one length: bars
    f"efficiency_efficiency_throughput_{LONG}_0.2_largestbatch",
    f"batch_efficiency_throughput_{LONG}_0.2_len16384",  # tokens/s vs batch
])
def test_efficiency_figures_are_written(report, name):
    out, _ = report
    png = out / "plots" / f"{name}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert png.with_suffix(".pdf").read_bytes()[:5] == b"%PDF-"
    assert f"plots/{png.name}" in (out / "report.md").read_text()


def test_a_single_context_length_is_drawn_as_bars(report):
    _, drawn = report
    assert SHORT in drawn and LONG in drawn  # the tiny model's one length; the throughput run's one length
    assert drawn.count(LONG) == 1  # the latency runs at two lengths are lines
