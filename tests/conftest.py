"""Shared fixtures: the tiny random model (seconds to build, meaningless scores) and its LanguageModel."""

from __future__ import annotations

import contextlib
import io
import os
import platform
import sys
from pathlib import Path

# Exact-token tests (tests/golden) hold on the CPU kernels they were recorded with, AVX2's. An AVX-512 host's
# kernels and MKL sum floats in another order: on an H200 host's Xeon, EMS's golden case decoded other tokens (at
# the commit before and after s14's changes) and all 21 matched once both were held to AVX2 (s14 call 5). Every
# x86 host runs the suite on AVX2 kernels; both are read when torch first runs a CPU kernel, so set before it loads.
if platform.machine().lower() in ("x86_64", "amd64"):
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", "AVX2")

import pytest  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
# For tests that run the Hydra app in this process: Hydra's logging setup (dictConfig) closes every existing
# handler, and absl's (imported with rouge_score) then closes its stream, pytest's capture, when sys.stderr
# is redirected at that moment. These overrides leave logging alone.
KEEP_LOGGING = ["hydra/job_logging=none", "hydra/hydra_logging=none"]


def pythonpath_with_repo() -> str:
    """PYTHONPATH for a subprocess that must import this checkout's kvbench: the repository first, then the
    caller's entries (on the GPU machine they hold the dependencies carried as wheels)."""
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def pytest_configure(config):
    config.addinivalue_line("markers", "full_disk: runs out of space on a small tmpfs (root with mount rights) "
                                       "or by injected ENOSPC (tests/full_disk.py)")


def kvbench_command(args: list[str], monkeypatch) -> tuple[int, str, str]:
    """``kvbench ARGS`` in this process, Hydra's logging left alone: (exit status, stdout, stderr)."""
    from kvbench.__main__ import entry

    monkeypatch.setattr(sys, "argv", ["kvbench", *args, *KEEP_LOGGING])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            entry()
            code = 0
        except SystemExit as stop:
            code = stop.code
    return code, out.getvalue(), err.getvalue()


def tiny_model_config(**overrides):
    cfg = OmegaConf.load(CONF / "model" / "tiny-llama-random.yaml")
    for key, value in overrides.items():
        cfg[key] = value
    return cfg


@pytest.fixture(scope="session")
def tiny_lm():
    from kvbench import models

    return models.load(tiny_model_config())


@pytest.fixture(scope="session")
def tiny_model(tiny_lm):
    return tiny_lm.model


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(0)
