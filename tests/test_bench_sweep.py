"""scripts/bench_sweep.py on a tiny model: every section it prints on the GPU runs, and on the CPU every point
of the fused sweeps predicts what it predicts alone."""

from __future__ import annotations

import re

import pytest

SWEEP = ["model=tiny-llama-random", "task=passkey", "task.context_lengths=[128]", "task.depths=[0,100]",
         "batch_size=2", "method=full,h2o", "budget=0.2"]


def test_a_tiny_sweep_reports_its_walls_ratios_and_identical_predictions(capsys):
    from scripts import bench_sweep

    assert bench_sweep.main(["--tpot", "--wide", "method=full,h2o,snapkv budget=0.2,0.5", *SWEEP]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("2 points (") and "tiny-llama-random / passkey, 2 samples, cpu" in out[0]
    starts = ["one after the other: ", "fused: ", "fused / one after the other: ", "fused / full cache alone (",
              "identical predictions: "]
    assert [line.replace("  ", "").startswith(start) for line, start in zip(out[1:6], starts)] == [True] * 5, out
    assert out[5] == "identical predictions: 4 / 4 (100.0 %)"
    assert [line.split(" |")[0] for line in out if line.startswith("| ") and not line.startswith("| point")] == [
        "| full full", "| h2o 0.2",  # TTFT and in-run TPOT alone and fused
        "| full full", "| h2o 0.2"]  # batch-1 TPOT
    tpot_rows = [line.split(" | ") for line in out if line.startswith(("| full full | ", "| h2o 0.2 | "))][2:]
    for row in tpot_rows:  # replayed steps do not run on a CPU: their columns say so
        assert row[4:] == ["nan", "nan", "nan |"], row
    [wide] = [line for line in out if line.startswith("wide sweep")]
    assert "5 runs fused" in wide and "/ full cache alone: " in wide  # full's two budgets are one run
    assert "(its first run, compiling: " in wide
    [parts] = [line for line in out if line.startswith("  shared prompt passes ")]
    seconds = [float(number) for number in re.findall(r"\d+(?:\.\d+)?", parts)]
    passes, compressions, points, decode, wall = seconds  # each part of the group's wall is inside it
    assert points == 5 and min(passes, compressions, decode) > 0 and passes + compressions + decode < wall
    [by_method] = [line for line in out if line.startswith("  prompt compressions by method: ")]
    per_method = {m: float(v) for m, v in re.findall(r"(\w+) (\d+\.\d+) s", by_method)}
    assert set(per_method) == {"full", "h2o", "snapkv"} and sum(per_method.values()) == pytest.approx(
        compressions, abs=0.02)
    assert sum(line.startswith("  decode batch of 5 points x 2 slots: ") for line in out) == 1  # the warm group's
    assert "  of its runs also run alone: identical predictions: 4 / 4 (100.0 %)" in out


def test_replayed_step_seconds_come_from_the_last_decode_batch_logged():
    import logging

    from scripts import bench_sweep

    logger = logging.getLogger("kvbench")
    with bench_sweep.decode_batches() as batches:
        assert batches.replayed_step_seconds() != batches.replayed_step_seconds()  # nan: no batch yet
        for steps, seconds in [({"replay": 4, "capture": 1}, {"replay": 0.4, "capture": 0.1}),
                               ({"replay": 28, "capture": 1, "warm-up": 1}, {"replay": 0.14, "capture": 0.05,
                                                                            "warm-up": 2.0})]:
            logger.info("decode batch", extra={"steps_by_kind": steps, "seconds_by_kind": seconds})
        logger.info("a record of something else")
    assert len(batches.batches) == 2 and batches.replayed_step_seconds() == 0.14 / 28
    assert batches not in logger.handlers
