"""Calls 43-46: the decode steps of the methods that observe their steps, with the code of `a0317ec` (a copy of its
``kvbench`` under ``old_a0317ec/``: one program a row for the evictions' scans, the step attention from four torch
operations) against this code (the rows' scans split over blocks; the step attention in one kernel; TOVA's from
call 46 on; CaM's, D2O's and WeightedKV's after call 46, not yet run on a GPU: ``ab cam,d2o,weightedkv,full``).

1. A/B in one process: the old Triton kernel modules loaded from the copy and their entry points (``SWAPPED``)
   swapped in (the dispatchers call them through their modules), each set's replayed step profiled by
   ``scripts.profile_points``, old, new, old, new. (Calls 43 and 46 swapped the first three entry points, the only
   ones whose kernels had changed.)
2. Token for token (call 44): the same prompts decoded by the old and the new code, each in a process of its own
   (budget 0.2, CUDA graphs, four 16k random prompts, 32 new tokens, batch 4); ``tokens METHODS old,old,new``
   (call 45) decodes with the old code twice, to see what two runs of the same code give.

    git archive a0317ec kvbench conf | tar -x -C old_a0317ec   # before the call
    PYTHONPATH=/tmp/site:. python3 results/gpu/2026-11-27/logs/split_scan_ab_call43.py ab        # call 43
    PYTHONPATH=/tmp/site:. python3 results/gpu/2026-11-27/logs/split_scan_ab_call43.py tokens    # call 44
    PYTHONPATH=/tmp/site:. python3 results/gpu/2026-11-27/logs/split_scan_ab_call43.py tokens d2o,weightedkv old,old,new
    PYTHONPATH=/tmp/site:. python3 results/gpu/2026-11-27/logs/split_scan_ab_call43.py ab tova,full   # call 46
    PYTHONPATH=/tmp/site:. python3 results/gpu/2026-11-27/logs/split_scan_ab_call43.py tokens tova,h2o,streamingllm

Session 8 compared CaM's, D2O's and WeightedKV's steps over blocks (``5bc13fd``, ``23bc0e9``) with their parent
(calls 47, 48), and the layer lanes' tokens with ``fa53334`` (call 52):

    git archive 7f3f5f8 kvbench conf | tar -x -C old_7f3f5f8
    KVBENCH_OLD=old_7f3f5f8 PYTHONPATH=/tmp/site:. python3 results/gpu/2026-11-27/logs/split_scan_ab_call43.py ab cam,d2o,weightedkv,full
    KVBENCH_OLD=old_7f3f5f8 PYTHONPATH=/tmp/site:. python3 results/gpu/2026-11-27/logs/split_scan_ab_call43.py tokens cam,d2o,weightedkv old,old,new
    KVBENCH_OLD=old_fa53334 PYTHONPATH=/tmp/site:. python3 results/gpu/2026-11-27/logs/split_scan_ab_call43.py tokens cam,tova,h2o old,new
"""
import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path

# the old code: a copy of a commit's kvbench and conf (KVBENCH_OLD)
OLD = Path.cwd() / os.environ.get("KVBENCH_OLD", "old_a0317ec")
TOKEN_METHODS = ("streamingllm", "h2o", "tova", "cam", "d2o", "weightedkv")


# the Triton entry points swapped (module, function): the dispatchers call them through their modules
SWAPPED = (("triton_slots", "evict_in_budget"), ("triton_slots", "evict_lowest"), ("triton_decode", "decode_attention"),
           ("triton_cam_step", "cam_step"), ("triton_d2o_step", "d2o_step"),
           ("triton_weightedkv_step", "weightedkv_step"), ("triton_observe", "observe_pass"))


def load_old(name: str, slots=None):
    """The old copy's kernel module ``name``; its own imports of ``triton_slots`` get the old ``slots``."""
    spec = importlib.util.spec_from_file_location(f"old_{name}", OLD / "kvbench" / "kernels" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass of the module looks its module up while being made
    current = sys.modules.get("kvbench.kernels.triton_slots")
    if slots is not None:
        sys.modules["kvbench.kernels.triton_slots"] = slots
    try:
        spec.loader.exec_module(module)
    finally:
        if slots is not None:
            sys.modules["kvbench.kernels.triton_slots"] = current
    return module


def swap(functions: dict) -> None:
    for (module, name), function in functions.items():
        setattr(importlib.import_module(f"kvbench.kernels.{module}"), name, function)


def ab(methods: list[str] | None = None) -> None:
    from kvbench import models
    from kvbench.hardware import copy_bandwidth
    from scripts.bench_decode_loop import prompts, ragged
    from scripts.profile_decode import configs
    from scripts.profile_points import point_engines, profile_points

    new = {(m, f): getattr(importlib.import_module(f"kvbench.kernels.{m}"), f) for m, f in SWAPPED}
    old_slots = load_old("triton_slots")
    modules = {"triton_slots": old_slots}
    for module, _ in SWAPPED:
        if module not in modules:
            modules[module] = load_old(module, old_slots)
    versions = {"new": new, "old": {(m, f): getattr(modules[m], f) for m, f in SWAPPED}}
    lm = models.load(configs("llama3.1-8b-shape-random", "full")[0])
    bandwidth = copy_bandwidth(lm.model.device)
    lines = []
    sets = [(65536, 1, "streamingllm", "0.2"), (65536, 1, "h2o", "0.2"), (65536, 1, "tova", "0.2"),
            (65536, 1, "cam", "0.2"), (65536, 1, "d2o", "0.2"), (65536, 1, "weightedkv", "0.2"),
            (65536, 1, "full", "0.2"),
            (16000, 2, "streamingllm", "0.2,0.35,0.5"), (16000, 2, "h2o", "0.2,0.35,0.5"),
            (16000, 2, "tova", "0.2,0.35,0.5"), (16000, 2, "cam", "0.2,0.35,0.5"), (16000, 2, "d2o", "0.2,0.35,0.5"),
            (16000, 2, "weightedkv", "0.2,0.35,0.5")]
    for length, slots, method, budgets in sets:
        if methods and method not in methods:
            continue
        batch = prompts(len(lm.tokenizer), ragged(length, slots))
        args = argparse.Namespace(model="llama3.1-8b-shape-random", methods=method, budgets=budgets, length=length)
        for version in ("old", "new", "old", "new"):
            swap(versions[version])
            engines = point_engines(args, lm.model)[method]
            lines.append(profile_points(engines, batch, 8, 6, bandwidth, f"{method} {length // 1000}k {version}"))
            del engines
    swap(versions["new"])
    print("                   set  points  step ms   GPU ms  kernels  per pt+lyr bound ms  fraction")
    print("\n".join(lines))


def call39():
    """``old_vs_new_tokens_call39``: its decoding (``run``) and its reading of a child's tokens (``decoded``)."""
    path = Path(__file__).with_name("old_vs_new_tokens_call39.py")
    spec = importlib.util.spec_from_file_location("old_vs_new_tokens_call39", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def decode_tokens(methods: list[str]) -> None:
    """Call 39's decoding (``old_vs_new_tokens_call39.run``: the same prompts, settings and output) for ``methods``."""
    module = call39()
    module.METHODS = tuple(methods)
    module.run()


def tokens(methods: list[str], runs: list[str]) -> None:
    site = os.environ.get("PYTHONPATH", "")
    decoded = call39().decoded
    got = {}
    for i, version in enumerate(runs):
        label = f"{version} {i}"
        env = dict(os.environ, PYTHONPATH=f"{OLD if version == 'old' else Path.cwd()}:{Path.cwd()}:{site}")
        got[label] = decoded(label, [__file__, "decode", ",".join(methods)], env, Path.cwd())
    labels = list(got)
    for one, other in zip(labels, labels[1:]):
        for name in methods:
            pairs = list(zip(got[one][name], got[other][name]))
            same = sum(a == b for a, b in pairs)
            first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in pairs]
            print(f"{one} vs {other} {name:>13}: {same}/{len(pairs)} identical (first differing token per prompt: "
                  f"{first})")


if __name__ == "__main__":
    step = sys.argv[1] if len(sys.argv) > 1 else "ab"
    if step == "ab":
        ab(sys.argv[2].split(",") if len(sys.argv) > 2 else None)
    elif step == "decode":
        decode_tokens(sys.argv[2].split(","))
    else:
        tokens(sys.argv[2].split(",") if len(sys.argv) > 2 else list(TOKEN_METHODS),
               sys.argv[3].split(",") if len(sys.argv) > 3 else ["old", "new"])
