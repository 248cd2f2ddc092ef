"""``scripts/profile_decode.py``'s timeline: where no kernel runs in a step, and which kernel pairs those gaps sit
between (``--gaps``), from kernel intervals alone (no GPU needed)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from scripts import profile_decode


def profiler(*kernels: tuple[float, float, str]) -> SimpleNamespace:
    events = [SimpleNamespace(device_type=torch.autograd.DeviceType.CUDA, name=name,
                              time_range=SimpleNamespace(start=start, end=end)) for start, end, name in kernels]
    return SimpleNamespace(events=lambda: events)


def test_gaps_are_charged_to_the_last_kernel_to_end_and_the_next_to_start():
    step = [(0, 10, "gemm"), (5, 14, "side"), (16, 20, "norm"), (30, 40, "gemm")]  # gaps: side->norm 2, norm->gemm 10
    prof = profiler(*step, *[(start + 100, end + 100, name) for start, end, name in step])
    summary, *gaps = profile_decode.timeline_lines(prof, 2, gaps=5)
    assert "span 0.040 ms" in summary and "none 0.012" in summary
    assert [line.split() for line in gaps] == [["gap", "10.0", "us", "x", "1.0", "norm", "->", "gemm"],
                                               ["gap", "2.0", "us", "x", "1.0", "side", "->", "norm"]]


def test_a_kernel_inside_a_longer_one_does_not_take_its_gap():
    prof = profiler((0, 50, "attention"), (10, 20, "side"), (60, 70, "combine"))
    _, *gaps = profile_decode.timeline_lines(prof, 1, gaps=5)
    assert [line.split()[1] for line in gaps] == ["10.0"] and gaps[0].split()[-3:] == ["attention", "->", "combine"]
