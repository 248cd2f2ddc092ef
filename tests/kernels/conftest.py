"""Kernel tests run every Triton kernel on the CPU through Triton's interpreter.

TRITON_INTERPRET must be set before a kernel module is imported (``triton.jit`` reads it when it wraps a
function); the kernel modules are imported lazily by ``kvbench.kernels.dispatch`` users and by the tests
below, after this file has run.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (atol, rtol) on outputs stored in the input dtype: both backends compute in float32 and round once when
# they store, so they may differ by one unit in the last place (2^-7 relative for bfloat16, 2^-10 float16).
OUTPUT_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 2**-7), torch.float16: (1e-3, 2**-10)}


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request):
    return request.param


@pytest.fixture
def output_tolerance(dtype) -> dict:
    atol, rtol = OUTPUT_TOLERANCE[dtype]
    return {"atol": atol, "rtol": rtol}
