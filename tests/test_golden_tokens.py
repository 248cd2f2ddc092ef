"""Every method decodes exactly as recorded in ``tests/golden/decode_tokens.json`` (see ``record.py``): the
engine's fast paths (static-capacity storage, in-place decode compression, statistics from the forward) must
not change a single generated token or realized cache size."""

from __future__ import annotations

import json

import pytest

from tests.golden.record import CASES, OUT, run_case

GOLDEN = json.loads(OUT.read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_method_decodes_as_recorded(tiny_model, name):
    from kvbench.kernels.dispatch import use_backend

    with use_backend("torch"):
        got = run_case(tiny_model, name)
    assert got == GOLDEN[name]
