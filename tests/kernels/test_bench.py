"""The kernel benchmark: exponent fit on known power laws, and a tiny end-to-end run writing its files."""

from __future__ import annotations

import pandas as pd
import pytest

from kvbench import bench
from kvbench.errors import ConfigError


def test_scaling_exponent_recovers_power_laws():
    lengths = [1024, 2048, 4096, 8192]
    rows = pd.DataFrame(
        [{"operation": "linear", "backend": "torch", "length": n, "seconds": 3e-6 * n, "complexity": "n"}
         for n in lengths]
        + [{"operation": "quadratic", "backend": "triton", "length": n, "seconds": 1e-9 * n**2, "complexity": "n^2"}
           for n in lengths]
    )
    fit = bench.scaling_exponents(rows).set_index("operation")["exponent"]
    assert fit["linear"] == pytest.approx(1.0)
    assert fit["quadratic"] == pytest.approx(2.0)


def test_tiny_run_writes_parquet_and_plots(tmp_path, capsys):
    bench.main(["kernels", "--lengths", "64,128", "--ops", "compact,scatter_merge", "--repeats", "1",
                "--head-dim", "16", "--out", str(tmp_path)])
    rows = pd.read_parquet(tmp_path / "kernels.parquet")
    assert len(rows) == 8  # 2 operations x 2 backends x 2 lengths
    assert set(rows["backend"]) == {"torch", "triton"} and (rows["seconds"] > 0).all()
    assert len(pd.read_parquet(tmp_path / "kernels_exponents.parquet")) == 4
    assert (tmp_path / "kernels.png").stat().st_size > 0 and (tmp_path / "kernels.pdf").stat().st_size > 0
    assert "triton/torch" in capsys.readouterr().out


def test_unknown_operation_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="accepted: decode_attention"):
        bench.main(["kernels", "--ops", "softmax", "--lengths", "64", "--out", str(tmp_path)])


def test_decode_steps_run_in_the_benchmark(tmp_path):
    """Each fused decode step runs in the benchmark with both backends (their outputs are compared in
    test_decode_steps.py)."""
    bench.main(["kernels", "--lengths", "40", "--ops", "cam_step,d2o_step,weightedkv_step,ems_step",
                "--repeats", "1", "--kv-heads", "2", "--head-dim", "16", "--out", str(tmp_path)])
    rows = pd.read_parquet(tmp_path / "kernels.parquet")
    assert len(rows) == 8 and (rows["seconds"] > 0).all()
