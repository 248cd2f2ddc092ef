"""scripts/bench_sweep.py on a tiny model: every section it prints on the GPU runs, and on the CPU every point
of the fused sweeps predicts what it predicts alone."""

from __future__ import annotations

import re

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
    [wide] = [line for line in out if line.startswith("wide sweep")]
    assert "5 runs fused" in wide and "/ full cache alone: " in wide  # full's two budgets are one run
    [parts] = [line for line in out if line.startswith("  shared prompt passes ")]
    seconds = [float(number) for number in re.findall(r"\d+(?:\.\d+)?", parts)]
    passes, compressions, points, decode, wall = seconds  # each part of the group's wall is inside it
    assert points == 5 and min(passes, compressions, decode) > 0 and passes + compressions + decode < wall
    assert "  of its runs also run alone: identical predictions: 4 / 4 (100.0 %)" in out
