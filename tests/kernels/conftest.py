"""Kernel tests run every Triton kernel on the CPU through Triton's interpreter, or compiled on a GPU.

``KVBENCH_KERNEL_TESTS`` picks the mode: ``interpret`` (default, CI) sets TRITON_INTERPRET=1 and keeps every
tensor on the CPU; ``cuda`` leaves TRITON_INTERPRET unset so that the kernels compile, and makes CUDA the
default device (tensors, random generators and the tiny model), so that the same tests compare the compiled
kernels with the torch references on the GPU:
    KVBENCH_KERNEL_TESTS=cuda python -m pytest -q tests/kernels

TRITON_INTERPRET must be set before a kernel module is imported (``triton.jit`` reads it when it wraps a
function); the kernel modules are imported lazily by ``kvbench.kernels.dispatch`` users and by the tests
below, after this file has run.
"""

from __future__ import annotations

import os

from kvbench.errors import ConfigError

MODES = ("interpret", "cuda")
MODE = os.environ.get("KVBENCH_KERNEL_TESTS", "interpret")
if MODE not in MODES:
    raise ConfigError(f"KVBENCH_KERNEL_TESTS={MODE!r}; accepted: {', '.join(MODES)}")
if MODE == "cuda":
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = "1"

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.conftest import pythonpath_with_repo  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (atol, rtol) on outputs stored in the input dtype: both backends compute in float32 and round once when
# they store, so they may differ by one unit in the last place (2^-7 relative for bfloat16, 2^-10 float16).
OUTPUT_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 2**-7), torch.float16: (1e-3, 2**-10)}
# Tests of test_dispatch.py that assert what happens to CPU tensors (torch under auto, refusal without the
# interpreter, CPU log lines): they do not describe CUDA tensors, so the cuda mode skips them.
CPU_TENSOR_TESTS = {"test_auto_runs_torch_on_cpu", "test_triton_on_cpu_without_interpreter_is_refused",
                    "test_each_choice_is_logged_once"}


def pytest_collection_modifyitems(config, items):
    if MODE != "cuda":
        return
    if not torch.cuda.is_available():
        raise pytest.UsageError("KVBENCH_KERNEL_TESTS=cuda needs a CUDA device")
    skip = pytest.mark.skip(reason="asserts CPU-tensor dispatch; covered by the interpret mode")
    for item in items:
        if item.originalname in CPU_TENSOR_TESTS:
            item.add_marker(skip)


# Modules whose code places tensors itself: the engine follows the model (built on the GPU below), the
# benchmark its --device. A CUDA default device would only move their deliberate CPU tensors (D2O's budget
# table, the benchmark's CPU generator) and break them.
OWN_DEVICE_MODULES = {"test_methods_backends", "test_bench"}


@pytest.fixture(autouse=True)
def kernel_device(request):
    """In cuda mode: CUDA default device, and ``torch.Generator()`` on it (the tests seed CPU-style
    generators, which torch refuses for CUDA tensors); restored after each test."""
    if MODE != "cuda" or request.module.__name__.rsplit(".", 1)[-1] in OWN_DEVICE_MODULES:
        yield
        return
    generator_class = torch.Generator

    def generator_on_default_device(device=None):
        return generator_class(device=torch.get_default_device() if device is None else device)

    torch.set_default_device("cuda")
    torch.Generator = generator_on_default_device
    try:
        yield
    finally:
        torch.Generator = generator_class
        torch.set_default_device(None)  # no default-device mode at all ("cpu" would leave one in place)


if MODE == "cuda":

    @pytest.fixture(scope="session")
    def tiny_lm():
        """The shared tiny model, built on the GPU (the parent conftest builds it on the CPU)."""
        from kvbench import models
        from tests.conftest import tiny_model_config

        return models.load(tiny_model_config(device="cuda"))

    @pytest.fixture(scope="session")
    def tiny_model(tiny_lm):
        """Overridden with ``tiny_lm``: a session fixture is made once per definition, so the parent's
        ``tiny_model``, made first inside this folder, would hand this GPU model to every later test outside it."""
        return tiny_lm.model


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request):
    return request.param


@pytest.fixture
def output_tolerance(dtype) -> dict:
    atol, rtol = OUTPUT_TOLERANCE[dtype]
    return {"atol": atol, "rtol": rtol}


def compile_for_sm90(script: str) -> str:
    """Run ``tests/kernels/<script>`` (it compiles kernels to sm_90 PTX and cubin, no GPU needed) in a process
    without TRITON_INTERPRET, where the compiler refuses what the interpreter accepts; its stdout."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": pythonpath_with_repo()}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name(script))], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
