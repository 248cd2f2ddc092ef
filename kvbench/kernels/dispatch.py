"""Which implementation of a kernel-layer operation runs: the torch reference or its Triton twin.

Every operation module keeps a float32 torch reference; its first lines ask ``use_triton(op, tensor)`` and,
when told so, call the Triton kernel of the same signature (imported lazily, so that ``import triton`` only
happens where a kernel runs). The backend is chosen, strongest first, by

1. ``use_backend(name)`` (a context manager for tests and the benchmark),
2. the environment variable ``KVBENCH_KERNELS`` (e.g. ``KVBENCH_KERNELS=torch`` switches Triton off),
3. the config value ``kernels.backend`` handed to ``set_backend`` by the runner (default ``auto``).

``auto`` runs Triton on CUDA tensors when triton imports, torch elsewhere. ``triton`` on CPU tensors works
only under Triton's interpreter (``TRITON_INTERPRET=1`` set before the kernels are imported): that is how
CI checks the kernels without a GPU. Each (operation, backend, device) choice is logged once.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from contextlib import contextmanager

from torch import Tensor

from kvbench.errors import ConfigError

BACKENDS = ("auto", "torch", "triton")
ENV_VAR = "KVBENCH_KERNELS"

log = logging.getLogger("kvbench.kernels")

_configured = "auto"
_forced: str | None = None
_logged: set[tuple[str, str, str]] = set()
ran: dict[str, str] = {}
"""Operation name -> backend of its most recent call ("torch" or "triton"); read by tests and the benchmark."""


def _check(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ConfigError(f"unknown kernels backend '{name}' (from {source}); accepted: {', '.join(BACKENDS)}")
    return name


def set_backend(name: str) -> None:
    """Set the configured backend (the runner passes ``cfg.kernels.backend``)."""
    global _configured
    _configured = _check(name, "kernels.backend")


@contextmanager
def use_backend(name: str):
    """Force a backend inside the block, over the environment and the config."""
    global _forced
    previous, _forced = _forced, _check(name, "use_backend")
    try:
        yield
    finally:
        _forced = previous


def requested_backend() -> str:
    """The backend asked for before looking at the device: forced > KVBENCH_KERNELS > config."""
    if _forced is not None:
        return _forced
    env = os.environ.get(ENV_VAR)
    if env:
        return _check(env.strip().lower(), ENV_VAR)
    return _configured


def triton_runs_on(device_type: str) -> bool:
    """Whether Triton kernels can run on tensors of this device type in this process."""
    if importlib.util.find_spec("triton") is None:
        return False
    if device_type == "cuda":
        return True
    return device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(op: str, tensor: Tensor) -> bool:
    """Decide (and record, and log once) whether ``op`` on ``tensor``'s device runs its Triton kernel."""
    requested = requested_backend()
    device = tensor.device.type
    if requested == "triton" and not triton_runs_on(device):
        raise ConfigError(
            f"kernels backend 'triton' cannot run '{op}' on {device} tensors here; accepted: 'torch' or 'auto', "
            "or CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 (set before triton is imported)"
        )
    triton = requested == "triton" or (requested == "auto" and device == "cuda" and triton_runs_on(device))
    backend = "triton" if triton else "torch"
    ran[op] = backend
    if (op, backend, device) not in _logged:
        _logged.add((op, backend, device))
        log.info("kernel %s runs on %s (%s tensors, requested %s)", op, backend, device, requested)
    return triton
