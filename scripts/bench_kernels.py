"""Kernel benchmark, same as ``python -m kvbench.bench kernels [options]`` (see kvbench/bench.py)."""

import sys

from kvbench.bench import main

if __name__ == "__main__":
    main(["kernels", *sys.argv[1:]])
