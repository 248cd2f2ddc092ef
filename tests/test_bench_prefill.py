"""The prompt-compression benchmark runs end to end on a tiny CPU layer and reports every row it promises."""

from __future__ import annotations

import math

from scripts import bench_prefill


def test_tiny_run_reports_every_method(capsys):
    rows = bench_prefill.main(["--device", "cpu", "--lengths", "64", "--heads", "4", "--kv-heads", "2",
                               "--head-dim", "16", "--hidden", "32", "--intermediate", "64", "--repeats", "1",
                               "--methods", "h2o,cam,d2o,ems"])
    assert [r["row"] for r in rows] == ["layer", "attention", "h2o", "cam", "d2o", "ems"]
    for r in rows[2:]:
        assert r["compress_ms"] > 0 and r["host_ms"] > 0 and r["ttft_ratio"] > 1 and math.isfinite(r["stats_ms"])
    assert "| 64 | ems |" in capsys.readouterr().out


def test_synthetic_neighbours_are_similar():
    # the drift that makes the merging methods merge: adjacent raw keys at cosine ~0.8
    args = bench_prefill.parse_args(["--device", "cpu", "--heads", "2", "--kv-heads", "1", "--head-dim", "64"])
    raw = bench_prefill.synthetic_layer(256, args, "cpu", bench_prefill.torch.float32)["raw_keys"]
    cosine = bench_prefill.torch.nn.functional.cosine_similarity(raw[:, :, 1:], raw[:, :, :-1], dim=-1)
    assert 0.7 < float(cosine.mean()) < 0.9
