"""A/B in one process (call 31): EMS's replayed decode step with the raw keys un-RoPE'd by the engine (a compiled
copy of the whole cache every step, then the fused step reads it: ``EMS.unrotates_in_place = False``) against
the fused step taking RoPE off the keys it reads (``True``, the new default). EMS's three points (budgets 0.2, 0.35,
0.5) x 2 rows at 16k, then one point x 1 row at 32k; each set profiled by ``scripts.profile_points``.

    PYTHONPATH=/tmp/site:. python3 results/gpu/2026-11-27/logs/ems_unrotate_ab_call31.py
"""
import argparse

from kvbench import models
from kvbench.hardware import copy_bandwidth
from kvbench.methods.ems import EMS
from scripts.bench_decode_loop import prompts, ragged
from scripts.profile_decode import configs
from scripts.profile_points import point_engines, profile_points

lm = models.load(configs("llama3.1-8b-shape-random", "full")[0])
bandwidth = copy_bandwidth(lm.model.device)
lines = []
for length, slots, budgets in ((16000, 2, "0.2,0.35,0.5"), (32000, 1, "0.2")):
    args = argparse.Namespace(model="llama3.1-8b-shape-random", methods="ems", budgets=budgets, length=length)
    batch = prompts(len(lm.tokenizer), ragged(length, slots))
    for in_registers in (False, True, False, True):
        EMS.unrotates_in_place = in_registers
        engines = point_engines(args, lm.model)["ems"]
        label = f"{length // 1000}k {'in-kernel' if in_registers else 'copy'}"
        lines.append(profile_points(engines, batch, 8, 12, bandwidth, label))
        del engines
print("       set  points  step ms   GPU ms  kernels  per pt+lyr bound ms  fraction")
print("\n".join(lines))
