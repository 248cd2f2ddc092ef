"""What the report's figures and headers claim: no kept-ratio heatmap that would be one colour, and CPU
peak memory under the same header as CUDA's (both count live tensor bytes, kvbench.memory)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvbench import store
from kvbench.report import main, plots
from kvbench.report.paper import FULL


def kept_rows(method: str, budget: str, kept: list[list[int]]) -> dict:
    return {"task": "passkey", "model": "tiny", "budget": budget, "row_method": method, "prompt_length": 10,
            "kept_per_layer_head": kept}


def test_kept_ratio_heatmap_skips_uniform_methods(tmp_path, monkeypatch):
    drawn = []

    def save(fig, out, name, formats):
        drawn.append((name, len(fig.axes) - 1, fig._suptitle.get_text()))  # panels (without the colour bar)
        return []

    monkeypatch.setattr(plots, "save", save)
    frame = pd.DataFrame([kept_rows("full", FULL, [[10, 10], [10, 10]]),
                          kept_rows("streamingllm", "0.5", [[5, 5], [5, 5]]),
                          kept_rows("snapkv", "0.5", [[5, 6], [4, 5]])])
    plots.kept_ratio(frame, ["full", "streamingllm", "snapkv"], tmp_path, ["png"])
    assert len(drawn) == 1 and drawn[0][1] == 1  # one figure, one panel: SnapKV's
    assert "same in every layer and head: Full Cache 1.00, StreamingLLM 0.50" in drawn[0][2]
    drawn.clear()
    plots.kept_ratio(frame[frame["row_method"] != "snapkv"], ["full", "streamingllm"], tmp_path, ["png"])
    assert drawn == []  # every method uniform: no figure at all


def test_cpu_peak_memory_has_the_cuda_header(tmp_path):
    for device, method in (("cpu", "full"), ("cpu", "snapkv")):
        rid = store.run_id({"method": method})
        metrics = pd.DataFrame([{"run_id": rid, "model": "tiny", "method": method, "budget": "full" if method == "full"
                                 else "0.2", "budget_kind": "fraction", "budget_value": np.nan if method == "full"
                                 else 0.2, "task": "efficiency", "dataset": "len64_bs1", "metric": metric,
                                 "value": 1.0, "n": 1, "device": device}
                                for metric in ("method.tpot_seconds", "method.peak_memory_bytes")])
        store.write_run(tmp_path, rid, "{}", pd.DataFrame({"run_id": [rid], "sample_id": ["s"]}), metrics, {})
    assert main(["--root", str(tmp_path), "--no-plots", "--no-paper"]) == 0
    header = next(line for line in (tmp_path / "report" / "tables" / "efficiency.md").read_text().splitlines()
                  if line.startswith("|"))
    assert "method.peak_memory_bytes (GiB) |" in header
    assert "method.tpot_seconds (ms)" in header
