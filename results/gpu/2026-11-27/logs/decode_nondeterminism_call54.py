"""Call 54 (the H100 of call 53): are the lanes test's three failures the lanes'? Each case decodes copies of one
prefill (tiny float32 model, 16 steps, eager) twice in line (``LAYER_STREAMS`` 1) and twice over 32 streams, and
prints the first step whose logits differ between two runs (None: bit for bit the same).

    PYTHONPATH=/tmp/site:. python3 results/gpu/2026-11-27/logs/decode_nondeterminism_call54.py

Printed: chelsea 1 vs 1: 5, 32 vs 32: 5, 1 vs 32: 5; ems_merge_all 1, 1, 1; ems_gamma_inf 2, 2, 1; d2o None, None,
None. Two in-line runs of the first three already differ: their decode-time compressions are not deterministic
run to run on CUDA, with or without the lanes.
"""
import copy

import torch

from kvbench import engine as engine_module
from kvbench import models
from kvbench.budget import Budget
from kvbench.engine import Engine
from tests.conftest import tiny_model_config
from tests.test_cuda_decode import decode
from tests.test_decode_paths import build, random_prompts

model = models.load(tiny_model_config(device="cuda")).model
for name in ("chelsea", "ems_merge_all", "ems_gamma_inf", "d2o"):
    prompts = random_prompts([45, 30], model.config.vocab_size)
    engine = Engine(model, build(name), Budget("tokens", 12))
    prefilled = engine.prefill(prompts, max_new_tokens=17)
    out = {}
    for run, streams in enumerate((1, 1, 32, 32)):
        engine_module.LAYER_STREAMS = streams
        session = copy.deepcopy(prefilled, memo={id(engine): engine, id(prefilled.timer): prefilled.timer})
        out[run] = decode(engine, prompts, 16, graphs=False, session=session)[0]

    def first_difference(a: int, b: int) -> int | None:
        return next((i for i, (x, y) in enumerate(zip(out[a], out[b])) if not torch.equal(x, y)), None)

    print(name, "1 vs 1:", first_difference(0, 1), "32 vs 32:", first_difference(2, 3), "1 vs 32:",
          first_difference(0, 2), flush=True)
