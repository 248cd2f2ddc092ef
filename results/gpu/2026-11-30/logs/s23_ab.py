"""A/B of EMS's look-up-table values launch, the barrier once (new) against once a tile (before), in one process:
registers a pseudo-module ``ab`` whose constant OLD_KERNEL=1 swaps ``_cluster_values`` for the committed one, then
runs ``scripts/bench_ems_kernels.py`` (``bench ARGS``) or ``s22_step_knobs.py`` (``steps ARGS``) with
``--set ab.OLD_KERNEL=1,0``.
Calls 1 and 5 ran it from ``ab/`` (carried, git-ignored) beside the committed kernel's module:
    mkdir -p ab && git show 60f9a1e:kvbench/kernels/triton_lut_attention.py > ab/triton_lut_attention_before.py
    cp results/gpu/2026-11-30/logs/s23_ab.py ab/
    PYTHONPATH=/tmp/site:$PWD python3 ab/s23_ab.py bench --only lut_attention --rows 1 --slots 13108 --context 65536 \
        --set ab.OLD_KERNEL=1,0"""
import importlib.util
import runpy
import sys

from kvbench.kernels import triton_lut_attention as lut
from scripts import bench_ems_kernels as bench

spec = importlib.util.spec_from_file_location("lut_before", "ab/triton_lut_attention_before.py")
before = importlib.util.module_from_spec(spec)
spec.loader.exec_module(before)
new_kernel = lut._cluster_values


class Switch:
    def __init__(self):
        self.__dict__["OLD_KERNEL"] = 0

    def __setattr__(self, name, value):
        self.__dict__[name] = value
        lut._cluster_values = before._cluster_values if value else new_kernel


bench.MODULES["ab"] = Switch()
what, sys.argv = sys.argv[1], [sys.argv[0]] + sys.argv[2:]
if what == "bench":
    bench.main()
else:
    runpy.run_path("results/gpu/2026-11-30/logs/s22_step_knobs.py", run_name="__main__")
