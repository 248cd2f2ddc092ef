"""Twenty-first session's prepared probe: EMS's and D2O's prompt compress at 32k (``scripts/bench_prefill.py``'s
synthetic Llama-3.1-8B layer, bf16), with ``triton_similarity.BEST_MATCH_TILES`` (sources a program, targets a step,
warps, stages) at each value in turn, one process. At 32k EMS's redundancy search compares 19,662 to-be-merged slots
with 6,523 centres a head, and D2O's nearest-kept search 26,214 evicted slots with 6,554 kept: every program re-reads
all the targets' rows, so wider source tiles read them fewer times. EMS's TTFT is 1.36x the full cache's against
H2O's 1.23-1.25 (the same column sums): the difference is its compress, of which this search (0.53 TFLOP a layer)
is likely the largest part; ``--profile`` names the kernels.

    python3 results/gpu/2026-11-30/logs/s21_best_match_tiles.py
"""

from __future__ import annotations

from kvbench.kernels import triton_similarity
from scripts import bench_prefill

for tiles in [(64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 4, 3), (64, 128, 4, 2), (128, 128, 8, 2)]:
    triton_similarity.BEST_MATCH_TILES = tiles
    print(f"== BEST_MATCH_TILES {tiles}", flush=True)
    bench_prefill.main(["--methods", "ems,d2o", "--lengths", "32768", "--repeats", "3", "--profile"])
