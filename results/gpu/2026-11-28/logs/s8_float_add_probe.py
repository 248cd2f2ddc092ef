"""Which Python line launches the float32 ``add`` kernel that the 32-row D2O and CaM decode steps show (one a layer,
~15 us each at 16k; not in EMS's step): every float32 ``aten.add``/``add_`` on CUDA tensors during the first two
decode steps (placement and capture), with the kvbench/transformers frames that called it.

    PYTHONPATH=$PWD python3 results/gpu/2026-11-28/logs/s8_float_add_probe.py --methods d2o,cam --slots 32
"""
import collections
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvbench import decode


class FloatAdds(TorchDispatchMode):
    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = args[0] if args else None
        if "add" in str(func) and isinstance(first, torch.Tensor) and first.is_cuda and first.dtype == torch.float32:
            frames = [f for f in traceback.extract_stack() if "kvbench" in f.filename or "transformers" in f.filename]
            where = "\n".join(f"    {f.filename.split('site-packages/')[-1]}:{f.lineno} {f.line}" for f in frames[-5:])
            self.seen[(str(func), tuple(first.shape), first.is_contiguous(), where)] += 1
        return func(*args, **(kwargs or {}))


seen = collections.Counter()
calls = collections.Counter()  # steps per decode batch
step = decode.DecodeBatch.step


def watched_step(self):
    calls[id(self)] += 1
    if calls[id(self)] > 2:
        return step(self)
    with FloatAdds(seen):
        return step(self)


decode.DecodeBatch.step = watched_step
sys.path.insert(0, ".")
from scripts import profile_points  # noqa: E402

sys.argv = ["profile_points", "--budgets", "0.2", "--length", "16000", "--alone-only", "--steps", "4", *sys.argv[1:]]
try:
    profile_points.main()
finally:
    for (func, shape, contiguous, where), n in seen.most_common(12):
        print(f"{n:5d} {func} {shape} contiguous={contiguous}\n{where}")
