"""A/B in one process (call 36): H2O's and StreamingLLM's replayed decode step with the budget's protected counts
made by torch operations before the eviction kernel (the code before `7dbdf7d`, restored here by patching
``LayerKV.evict_in_budget``) against made inside it (the new one-launch step). Each method's three points (budgets
0.2, 0.35, 0.5) x 2 rows at 16k, then one point x 1 row at 64k; each set profiled by ``scripts.profile_points``.

    PYTHONPATH=/tmp/site:. python3 results/gpu/2026-11-27/logs/evict_in_budget_ab_call36.py
"""
import argparse

import torch

from kvbench import models
from kvbench.hardware import copy_bandwidth
from kvbench.kernels.select import eviction_order, heavy_split
from kvbench.kv import LayerKV
from scripts.bench_decode_loop import prompts, ragged
from scripts.profile_decode import configs
from scripts.profile_points import point_engines, profile_points

in_kernel = LayerKV.evict_in_budget


def by_torch(self, scores, n_keep, sinks, heavy_ratio):
    """The step before 7dbdf7d: the protected counts from torch operations, then ``evict_lowest``."""
    keep = torch.minimum(n_keep.to(self.lengths).unsqueeze(-1).expand_as(self.lengths), self.lengths)
    if heavy_ratio is None:
        self.evict_lowest(*eviction_order(self.positions, keep, sinks))
    else:
        row_sinks, recent = heavy_split(keep, heavy_ratio, sinks)
        self.evict_lowest(scores, row_sinks.squeeze(-1), recent.squeeze(-1))


lm = models.load(configs("llama3.1-8b-shape-random", "full")[0])
bandwidth = copy_bandwidth(lm.model.device)
lines = []
for length, slots, budgets in ((16000, 2, "0.2,0.35,0.5"), (64000, 1, "0.2")):
    batch = prompts(len(lm.tokenizer), ragged(length, slots))
    for method in ("streamingllm", "h2o"):
        args = argparse.Namespace(model="llama3.1-8b-shape-random", methods=method, budgets=budgets, length=length)
        for fused in (False, True, False, True):
            LayerKV.evict_in_budget = in_kernel if fused else by_torch
            engines = point_engines(args, lm.model)[method]
            label = f"{method} {length // 1000}k {'in-kernel' if fused else 'torch'}"
            lines.append(profile_points(engines, batch, 8, 8, bandwidth, label))
            del engines
LayerKV.evict_in_budget = in_kernel
print("                   set  points  step ms   GPU ms  kernels  per pt+lyr bound ms  fraction")
print("\n".join(lines))
