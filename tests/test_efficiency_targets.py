"""The targets table (scripts/efficiency_targets.py) never prints a miss that reads like a hit."""

from scripts.efficiency_targets import markdown, row


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
