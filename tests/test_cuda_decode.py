"""Decoding on a GPU: CUDA graphs replay what eager steps compute, and a steady step never synchronises.

Skipped without CUDA (CI has none); the GPU runs (``scripts/gpu_bench.py``) run it on every method.
"""

from __future__ import annotations

import pytest
import torch

from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.graphs import DecodeGraph
from tests.conftest import tiny_model_config
from tests.test_decode_paths import CASES, build, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def cuda_model():
    from kvbench import models

    return models.load(tiny_model_config(device="cuda")).model


def decode(engine: Engine, prompts, steps: int, tokens: list | None = None, graphs: bool = False):
    """Logits of every step; feeds ``tokens`` when given (teacher forcing), else the argmax."""
    session = engine.prefill(prompts, max_new_tokens=steps + 1)
    runner = DecodeGraph(session) if graphs else None
    logits, fed = [], []
    for i in range(steps):
        logits.append(session.logits.float().clone())
        token = session.logits.argmax(-1) if tokens is None else tokens[i]
        fed.append(token)
        if runner is None:
            session.feed(token.view(-1, 1))
        else:
            runner.step(token)
    return logits, fed, runner


@pytest.mark.parametrize("name", CASES)
def test_cuda_graph_steps_compute_what_eager_steps_compute(cuda_model, name):
    prompts = random_prompts([45, 30], cuda_model.config.vocab_size)
    engine = Engine(cuda_model, build(name), Budget("tokens", 12))
    eager, tokens, _ = decode(engine, prompts, 16)
    graphed, _, runner = decode(engine, prompts, 16, tokens, graphs=True)
    for a, b in zip(eager, graphed):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    method = engine.method
    # a step repeats (and replays) unless the method compresses through ``compress`` at every step
    repeats = method.evicts_in_place or not method.compress_during_decode or method.decode_interval > 1
    assert (runner.replays > 0) == repeats


@pytest.mark.parametrize("name", CASES)
def test_steady_decode_step_does_not_synchronise(cuda_model, name):
    method = build(name)
    engine = Engine(cuda_model, method, Budget("tokens", 12))
    session = engine.prefill(random_prompts([45, 30], cuda_model.config.vocab_size), max_new_tokens=12)
    tokens = session.logits.argmax(-1).view(-1, 1)
    session.feed(tokens)
    for _ in range(3):
        due = method.compress_during_decode and (session.decode_steps + 1) % method.decode_interval == 0
        if due and not engine.in_place_eviction(1):
            session.feed(tokens)
            continue
        torch.cuda.set_sync_debug_mode("error")
        try:
            session.feed(tokens)
        finally:
            torch.cuda.set_sync_debug_mode("default")
