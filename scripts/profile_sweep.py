"""Where a fused group's wall goes on the host: the group run twice in one process (the first compiles its
kernels), the second under cProfile. Prints the second run's breakdown (``bench_sweep``: shared passes,
compressions, decode steps, wall) and the profile's top functions by own and by cumulative time; the rest of the
wall is what the profile shows outside those three.

    python -m scripts.profile_sweep model=llama3.1-8b-shape-random task=niah 'task.context_lengths=[16000]' \
        batch_size=8 method=full,h2o,ems budget=0.2,0.35,0.5
"""

from __future__ import annotations

import cProfile
import contextlib
import io
import pstats
import sys
import tempfile
from pathlib import Path

from scripts.bench_sweep import breakdown, compressions_by_method, run_fused

TOP = 45


def main(overrides: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="kvbench-profile-sweep-") as tmp, contextlib.redirect_stdout(sys.stderr):
        run_fused(overrides, Path(tmp) / "cold")
        profiler = cProfile.Profile()
        profiler.enable()
        runs = run_fused(overrides, Path(tmp) / "warm")
        profiler.disable()
    print(breakdown(runs))
    print(compressions_by_method(runs))
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(TOP)
        print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
