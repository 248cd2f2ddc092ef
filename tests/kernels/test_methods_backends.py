"""Every configured method gives the same generation and the same kept slots with either kernel backend."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.kernels import dispatch
from kvbench.kernels.dispatch import use_backend

# Every method in the fast suite (about 20 s for all twelve under the interpreter): a method's Triton branches,
# prompt and decode, run nowhere else on a machine without a GPU (CaM's prompt merge once called its kernel
# with a name it did not define, and only a GPU run found it)
METHOD_CONFIGS = [pytest.param(path, id=path.stem)
                  for path in sorted((Path(__file__).resolve().parents[2] / "conf" / "method").glob("*.yaml"))]


@pytest.mark.parametrize("config", METHOD_CONFIGS)
def test_method_identical_with_torch_and_triton(tiny_model, config):
    root = OmegaConf.create({"seed": 0, "method": OmegaConf.load(config)})  # method configs may use ${seed}
    method = instantiate(root.method)
    prompt = torch.randint(3, tiny_model.config.vocab_size, (45,), generator=torch.Generator().manual_seed(5)).tolist()
    runs = {}
    for backend in ("torch", "triton"):
        dispatch.ran.clear()
        with use_backend(backend):
            engine = Engine(tiny_model, method, Budget("fraction", 0.5))
            runs[backend] = engine.generate([prompt], max_new_tokens=4, stop_token_ids=set())[0]
        assert set(dispatch.ran.values()) <= {backend}
    assert runs["triton"].tokens == runs["torch"].tokens
    assert runs["triton"].kept_per_layer_head == runs["torch"].kept_per_layer_head
