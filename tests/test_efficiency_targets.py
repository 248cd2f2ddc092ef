"""The targets table (scripts/efficiency_targets.py) never prints a miss that reads like a hit, and says whether a
TPOT miss is its first decode step's."""

import pandas as pd

from scripts.efficiency_targets import AFTER_FIRST, GPU_TARGETS, TPOT, markdown, row, table


def test_a_value_that_rounds_to_its_bound_shows_its_third_digit_and_its_miss_a_decimal():
    near = row("TPOT / kvbench full", "m", 65536, "d2o", 0.8534, 0.85, "<=")
    assert near["met"] == "no (+0.4%)"
    assert "| 0.853 | <= 0.85 | no (+0.4%) |" in markdown([near])


def test_a_clear_miss_and_a_hit_keep_two_digits():
    miss = row("TPOT / kvbench full", "m", 32768, "ems", 1.1525, 1.05, "<=")
    hit = row("full: bytes-read bound / TPOT", "m", 32768, "full", 0.7312, 0.70, ">=")
    table = markdown([miss, hit])
    assert "| 1.15 | <= 1.05 | no (+10%) |" in table
    assert "| 0.73 | >= 0.70 | yes |" in table


def test_a_tpot_ratio_carries_its_ratio_after_the_first_step():
    def metric(method, name, value):
        return {"model": "m", "method": method, "context": 32768, "graphs": True, "cell": "bs1", "chunk": None,
                "metric": name, "value": value}

    df = pd.DataFrame([metric("d2o", TPOT, 1.1234), metric("d2o", AFTER_FIRST, 0.9312),
                       metric("h2o", TPOT, 0.98)])  # a run written before the split: no note
    rows = {r["method"]: r for r in table(df, GPU_TARGETS) if r["target"] == "TPOT / kvbench full"}
    assert rows["d2o"]["met"] == "no (+7%); 0.93 after the first step"
    assert rows["h2o"]["met"] == "yes"
