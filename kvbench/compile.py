"""Decode passes through compiled decoder layers (``engine.compile``), so that their elementwise chains fuse.

A decode step of an 8B model at batch 1 launches ~1,600 kernels, most of them tiny elementwise ones
(RMSNorm's seven, RoPE's ten, SiLU * mul, residual adds, casts) that cost more in launches and memory round
trips than they compute. ``torch.compile`` (inductor; no cudagraphs mode: kvbench captures its own graphs,
``kvbench.graphs``) fuses each chain into one kernel.

What is compiled: every decoder layer, the final norm and the rotary embedding, through the compiled-call
slot ``nn.Module.compile()`` fills, installed only for the engine's one-token passes and restored right
after: prompt passes, plain ``model.generate`` and every other use of the model run the eager modules, and
no modeling code is copied or patched. Inside a layer, kvbench's attention function and the cache's
``update`` are excluded from tracing (``torch.compiler.disable``: they make host decisions from the cache's
host mirror), so dynamo splits the layer there and compiles what lies around them: input norm, projections
and RoPE; then output projection, residual, norm, MLP and residual. The layer index, an integer attribute of
every attention module, is traced as a dynamic integer (``allow_unspec_int_on_nn_module``), so that all
layers share one compiled code instead of recompiling per layer. The first pass of each new shape compiles
(seconds); a CUDA graph is captured only after an eager step of the same shapes (``DecodeGraph``), so no
compilation ever runs inside a capture.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from kvbench.errors import ConfigError

COMPILE_SETTINGS = ("auto", True, False)


def compile_enabled(setting, device: torch.device, cuda_graphs: bool) -> bool:
    """``engine.compile``: true, false, or auto (on for a CUDA model whose decode steps replay as CUDA graphs:
    compiling costs seconds per shape, which only a graph-replayed decode repays without fail)."""
    if setting not in COMPILE_SETTINGS or isinstance(setting, int) and not isinstance(setting, bool):
        raise ConfigError(f"engine.compile={setting!r}; accepted: auto, true, false")
    if setting == "auto":
        return device.type == "cuda" and cuda_graphs
    return setting


def compiled_modules(model: nn.Module) -> list[nn.Module]:
    """The modules a decode pass runs compiled: every decoder layer, the final norm, the rotary embedding
    (Llama, Mistral and Qwen2 name them alike)."""
    body = model.model
    return [*body.layers, *(m for m in (getattr(body, "norm", None), getattr(body, "rotary_emb", None)) if m)]


COMPILED_CALL = "_kvbench_compiled_call"  # the module attribute that keeps its compiled call between passes


def _compiled_call(module: nn.Module) -> Callable:
    """The module's call compiled once (as ``nn.Module.compile`` does it), kept on the module for later passes."""
    if COMPILED_CALL not in module.__dict__:
        module.__dict__[COMPILED_CALL] = torch.compile(module._call_impl)
    return module.__dict__[COMPILED_CALL]


def prepare_compiled_calls(model: nn.Module) -> None:
    """Make every compiled module's compiled call now, when an engine is built: ``torch.compile`` deep-copies
    inductor's configuration for each call it wraps (about 5 ms a module on a GPU host, 170 ms for an 8B
    model's 34 modules), which the first decode step of every newly loaded model would otherwise pay, inside
    its timed step or graph capture. Compiling itself still happens at the first pass of each shape."""
    for module in compiled_modules(model):
        _compiled_call(module)


@functools.cache
def compiled_function(function: Callable) -> Callable:
    """``function`` through torch.compile (inductor, no cudagraphs mode), compiled once per process: decode-time
    work outside the model whose elementwise chain would otherwise launch a kernel per operation (EMS's raw keys
    at every step: RoPE's cos, sin, rotate_half and products over every stored slot of every layer)."""
    return torch.compile(function)


@contextmanager
def compiled_decode(model: nn.Module, enabled: bool):
    """Run the block's forward passes through the compiled modules when ``enabled``; restore them after."""
    modules = compiled_modules(model) if enabled else []
    previous = [m._compiled_call_impl for m in modules]
    if any(p is not None and p is m.__dict__.get(COMPILED_CALL) for m, p in zip(modules, previous)):  # nested
        modules, previous = [], []
    for module in modules:
        module._compiled_call_impl = _compiled_call(module)
    try:
        with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True) if modules else nullcontext():
            yield
    finally:
        for module, call in zip(modules, previous):
            module._compiled_call_impl = call
