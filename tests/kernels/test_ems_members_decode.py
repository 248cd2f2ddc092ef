"""EMS "w.o. pos" decode steps attend to the look-up table's members from the stored slots
(``kernels.lut_attention.lut_attention_at_centres``), not through the expanded view: the same logits and caches as
the view, with live members in the table (tau = 0 merges every TBM token, a window of 4 leaves centres; the golden
"ems" case merges none), with either kernel backend."""

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

    def expand(self, layer, kv, rotate, position_limit=None):
        expansion = super().expand(layer, kv, rotate, position_limit)
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
    kernel = attention.lut_attention_at_centres

    def counting(*args, **kwargs):
        live.append(int((args[5] >= 0).sum()))  # the table's entries in use
        return kernel(*args, **kwargs)

    monkeypatch.setattr(attention, "lut_attention_at_centres", counting)
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


def test_members_found_through_the_position_map_as_by_the_sort(tiny_model, monkeypatch):
    """The Triton path finds the members' centre slots through a map as wide as the pass's position limit (in the
    attention's own launches), or without a limit by a sort: the same integers, so the same logits and caches (to
    the bit on a CPU; on CUDA the members' weights are float atomic adds, so two runs differ in the last bits). The
    limit here is a multiple of 16 positions (it changes while the rows decode); one short of a stored centre's
    position would drop that centre's members."""
    from kvbench import engine as engine_module
    from kvbench.kernels import triton_lut_attention

    monkeypatch.setattr(engine_module, "POSITION_LIMIT_STEP", 16)
    at_centres = triton_lut_attention.lut_attention_at_centres
    widths = []

    def checked(query, keys, values, positions, lengths, centre, norm, position_limit, *args):  # at every step
        real = torch.arange(positions.shape[-1]) < lengths.unsqueeze(-1)
        assert int(positions[real].max()) < position_limit  # the bound the map relies on
        widths.append(position_limit)
        return at_centres(query, keys, values, positions, lengths, centre, norm, position_limit, *args)

    monkeypatch.setattr(triton_lut_attention, "lut_attention_at_centres", checked)
    runs = {}
    with use_backend("triton"):
        runs["map"] = decode(tiny_model, EMS(tau=0.0, window=4))
        monkeypatch.setattr(engine_module.Session, "position_limit", lambda self, q: None)
        runs["sort"] = decode(tiny_model, EMS(tau=0.0, window=4))
    assert len(set(widths)) >= 2  # the limit moved while the rows decoded
    (logits, layers), (want_logits, want_layers) = runs["map"], runs["sort"]
    tolerance = {"atol": 0, "rtol": 0} if logits[0].device.type == "cpu" else {"atol": 1e-5, "rtol": 1e-5}
    for got, want in zip(logits, want_logits):
        torch.testing.assert_close(got, want, **tolerance)
    for got, want in zip(layers, want_layers):
        assert torch.equal(got.kv.positions, want.kv.positions)
        torch.testing.assert_close(got.kv.keys, want.kv.keys, **tolerance)
        for name in got.kv.tables:
            torch.testing.assert_close(got.kv.tables[name], want.kv.tables[name], **tolerance)
