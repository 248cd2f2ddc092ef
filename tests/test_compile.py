"""``engine.compile``: decode passes through compiled decoder layers give the eager logits, and the model
is left as it was (plain ``model.generate`` and prompt passes never run compiled)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvbench import compile as kvbench_compile
from kvbench.budget import Budget
from kvbench.compile import compile_enabled, compiled_modules
from kvbench.engine import Engine
from kvbench.errors import ConfigError
from kvbench.kernels.dispatch import use_backend
from kvbench.methods.h2o import H2O


def decode_logits(model, compile: bool, steps: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (45, 30)]
    session = Engine(model, H2O(), Budget("tokens", 24), compile=compile).prefill(prompts, max_new_tokens=steps)
    logits = []
    for step in range(steps):
        session.feed(session.logits.argmax(-1).view(-1, 1), static_shapes=step % 2 == 1)  # both decode paths
        logits.append(session.logits.clone())
    return torch.stack(logits)


@pytest.mark.slow  # compiling the tiny model's layers from scratch takes ~1 minute of CPU
def test_compiled_decode_gives_the_eager_logits_and_restores_the_model(tiny_model):
    with use_backend("torch"):
        eager = decode_logits(tiny_model, compile=False)
        compiled = decode_logits(tiny_model, compile=True)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    assert all(module._compiled_call_impl is None for module in compiled_modules(tiny_model))


def test_only_one_token_passes_run_compiled(tiny_model, monkeypatch):
    """The wiring, without compiling: every compiled module's call is installed for the decode passes alone
    (never for the prompt pass), and the model's own calls are back afterwards."""
    passes = []

    def fake_compile(call):
        def compiled(*args, **kwargs):
            passes.append(args[0].shape[1] if isinstance(args[0], torch.Tensor) else None)
            return call(*args, **kwargs)
        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    for module in compiled_modules(tiny_model):  # compiled calls kept from an earlier test: made again
        monkeypatch.delitem(module.__dict__, kvbench_compile.COMPILED_CALL, raising=False)
    with use_backend("torch"):
        decode_logits(tiny_model, compile=True, steps=2)
    modules = compiled_modules(tiny_model)
    assert len(passes) == 2 * len(modules)  # two decode passes, through every module once each
    assert set(passes) <= {1, None}  # one-token hidden states (the rotary embedding's first argument too)
    assert all(module._compiled_call_impl is None for module in modules)


def test_an_engine_makes_every_compiled_call_when_it_is_built(tiny_model, monkeypatch):
    """torch.compile's wrapper (a deep copy of inductor's configuration each) is made with the engine, not inside
    the first decode step or graph capture of a run; an engine that does not compile makes none."""
    made = []
    monkeypatch.setattr(torch, "compile", lambda call: made.append(call) or call)
    for module in compiled_modules(tiny_model):
        monkeypatch.delitem(module.__dict__, kvbench_compile.COMPILED_CALL, raising=False)
    modules = compiled_modules(tiny_model)
    try:
        Engine(tiny_model, H2O(), Budget("tokens", 24), compile=False)
        assert made == []
        Engine(tiny_model, H2O(), Budget("tokens", 24), compile=True)
        assert len(made) == len(modules) and all(kvbench_compile.COMPILED_CALL in m.__dict__ for m in modules)
        with use_backend("torch"):
            decode_logits(tiny_model, compile=True, steps=2)
        assert len(made) == len(modules), "the decode steps made none"
    finally:  # the stand-in calls must not outlive the test
        for module in modules:
            module.__dict__.pop(kvbench_compile.COMPILED_CALL, None)


def test_compile_setting():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compile_enabled("auto", cuda, cuda_graphs=True) and not compile_enabled("auto", cuda, cuda_graphs=False)
    assert not compile_enabled("auto", cpu, cuda_graphs=False) and compile_enabled(True, cpu, cuda_graphs=False)
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match=f"engine.compile={bad!r}; accepted: auto, true, false"):
            compile_enabled(bad, cpu, cuda_graphs=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["full", "h2o"])
def test_compiled_layers_replay_in_cuda_graphs(name):
    """What the GPU runs by default (auto): compiled layers captured in the decode graph, against eager."""
    from kvbench import models
    from tests.conftest import tiny_model_config
    from tests.test_cuda_decode import decode
    from tests.test_decode_paths import build, random_prompts

    model = models.load(tiny_model_config(device="cuda")).model
    prompts = random_prompts([45, 30], model.config.vocab_size)
    eager, tokens, _ = decode(Engine(model, build(name), Budget("tokens", 12), compile=False), prompts, 12)
    engine = Engine(model, build(name), Budget("tokens", 12), cuda_graphs=True)
    assert engine.compile_decode  # auto: on for a CUDA model with graphs
    graphed, _, runner = decode(engine, prompts, 12, tokens, graphs=True)
    for a, b in zip(eager, graphed):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    assert runner.replays > 0


def test_decode_steps_unrotate_keys_through_the_compiled_function(tiny_model, monkeypatch):
    """The wiring, without compiling: EMS's raw keys go through ``compiled_function(unrotate_keys)`` in decode
    steps that compress (``decode_path="compress"``) of a compiling engine only (prompt compression and a
    non-compiling engine run them eagerly); for its in-place steps the engine un-RoPEs nothing and hands the step
    the model's RoPE instead (``Method.unrotates_in_place``: the Triton step takes it off the keys it reads)."""
    from kvbench import engine as engine_module
    from kvbench.attention import unrotate_keys
    from kvbench.methods.ems import EMS

    wrapped, unrotated = [], []
    monkeypatch.setattr(engine_module, "compiled_function", lambda fn: wrapped.append(fn) or fn)
    monkeypatch.setattr(engine_module, "compiled_decode", lambda model, enabled: contextlib.nullcontext())
    monkeypatch.setattr(engine_module, "unrotate_keys", lambda *args: unrotated.append(1) or unrotate_keys(*args))
    prompt = torch.randint(3, tiny_model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    layers = tiny_model.config.num_hidden_layers
    for compile, decode_path, expected in ((True, "compress", 2), (False, "compress", 0), (True, "in_place", 0)):
        wrapped.clear()
        session = Engine(tiny_model, EMS(window=4), Budget("tokens", 12), compile=compile,
                         decode_path=decode_path).prefill([prompt.tolist()], max_new_tokens=2)
        assert wrapped == []  # prompt compression: eager
        unrotated.clear()
        for _ in range(2):
            session.feed(session.logits.argmax(-1).view(-1, 1))
        assert len(wrapped) == expected * layers
        assert set(wrapped) <= {engine_module.unrotate_keys}
        assert len(unrotated) == (0 if decode_path == "in_place" else 2 * layers)
