"""EMS "w.o. pos" decode steps attend to the look-up table's members from the stored slots
(``kernels.lut_attention``), not through the expanded view: the same logits and caches as the view, with live
members in the table (tau = 0 merges every TBM token, a window of 4 leaves centres; the golden "ems" case merges none), with either
kernel backend."""

from __future__ import annotations

import pytest
import torch

from kvbench import attention
from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.kernels.dispatch import use_backend
from kvbench.kv import Expansion
from kvbench.methods.ems import EMS
from tests.golden.record import random_prompts


class ViewEMS(EMS):
    """EMS whose expansion offers only the view: every pass attends over the expanded entries."""

    def expand(self, layer, kv, rotate):
        expansion = super().expand(layer, kv, rotate)
        return None if expansion is None else Expansion(expansion.view)


def decode(model, method, steps: int = 12) -> tuple[list, list]:
    """Greedy steps from two ragged prompts: the logits of every step (B, V), and the final cache's layers."""
    engine = Engine(model, method, Budget("tokens", 12), compile=False)  # the counting wrapper reads the host
    session = engine.prefill(random_prompts([41, 30], model.config.vocab_size, 0), max_new_tokens=steps)
    logits = []
    for _ in range(steps):
        logits.append(session.logits)
        session.feed(session.logits.argmax(-1).view(-1, 1))
    return logits, session.cache.layers


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_members_decode_as_the_view(tiny_model, monkeypatch, backend):
    live = []
    kernel = attention.lut_attention

    def counting(*args, **kwargs):
        live.append(int(args[6].sum()))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(attention, "lut_attention", counting)
    with use_backend(backend):
        logits, layers = decode(tiny_model, EMS(tau=0.0, window=4))
        assert live and max(live) > 0  # the members' path ran, with members in the table
        live.clear()
        view_logits, view_layers = decode(tiny_model, ViewEMS(tau=0.0, window=4))
    assert not live  # the view's decode never calls it
    for got, want in zip(logits, view_logits):  # float32: the same sums in another order
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for got, want in zip(layers, view_layers):  # the step attention every step added to the scores
        assert torch.equal(got.kv.positions, want.kv.positions)
        torch.testing.assert_close(got.kv.state["s_glo"], want.kv.state["s_glo"], atol=1e-6, rtol=1e-5)
