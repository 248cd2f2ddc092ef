"""EMS's one-query attention over stored slots and LUT members (``kernels.lut_attention``): the Triton kernel
against the torch reference on odd shapes (one slot, widths no multiple of the blocks, GQA, no table, no live
member, every member on one centre, fp32/bf16), and the reference against the expanded view it replaces
(``expand_lut``, ``decode_attention``, ``fold_entries``); and the members given by their centres' positions
(``lut_attention_at_centres``) against ``centre_slots`` then ``lut_attention``."""

from __future__ import annotations

import pytest
import torch

from kvbench.kernels.decode_attention import decode_attention
from kvbench.kernels.dispatch import use_backend
from kvbench.kernels.lut_attention import lut_attention, lut_attention_at_centres
from kvbench.kernels.lut_expand import centre_slots, expand_lut, fold_entries
from tests.kernels.test_lut_expand import CENTRE_SHAPES, centre_case

SHAPES = [  # B, H, group, T, E, D, D_v
    (1, 1, 1, 1, 1, 4, 4),
    (2, 3, 1, 37, 70, 12, 20),
    (1, 2, 4, 300, 700, 64, 64),
    (2, 2, 3, 65, 0, 16, 16),
    (1, 2, 2, 130, 2100, 16, 8),  # a table of several member splits (five of ``MEMBER_BLOCKS``' 512 on the CPU)
]
LAYOUTS = ("random", "one_centre", "none_live")


def layer_case(B, H, group, T, E, D, DV, dtype, layout="random", seed=0):
    """query (B, H * group, 1, D) and a layer of ragged rows (one of length 1) with its members: live at random
    on centres in [0, length) (``random``), all live on slot 0 (``one_centre``), or none live."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(B, H * group, 1, D, generator=g).to(dtype)
    keys = (torch.randn(B, H, T, D, generator=g) * 2).to(dtype)
    values = torch.randn(B, H, T, DV, generator=g).to(dtype)
    lengths = torch.randint(1, T + 1, (B, H), generator=g)
    lengths.view(-1)[0] = 1
    live = torch.rand(B, H, E, generator=g) < {"random": 0.6, "one_centre": 2.0, "none_live": -1.0}[layout]
    slot = (torch.rand(B, H, E, generator=g) * lengths.unsqueeze(-1)).long()
    if layout == "one_centre":
        slot.zero_()
    norm = torch.where(live, torch.rand(B, H, E, generator=g) * 3 * D ** 0.5, -1.0)
    return query, keys, values, lengths, slot, norm, live


def on_both_backends(case: tuple, scaling: float) -> tuple[tuple, tuple]:
    """(output, step) of ``lut_attention`` over ``case`` with the torch reference, then with the Triton kernel."""
    out = {}
    for backend in ("torch", "triton"):
        with use_backend(backend):
            out[backend] = lut_attention(*case, scaling, want_step=True)
    return out["torch"], out["triton"]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_lut_attention_triton_matches_torch(shape, layout, dtype):
    B, H, group, T, E, D, DV = shape
    case = layer_case(*shape, dtype, layout)
    (o0, s0), (o1, s1) = on_both_backends(case, D ** -0.5)
    assert o1.shape == (B, H * group, 1, DV) and o1.dtype == dtype and s1.shape == (B, H, T)
    # float32 sums in another order; on bf16 the kernel rounds the probabilities to bf16 for the P @ V product
    # (as triton_decode does): a bf16 rounding of the output at most
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 2 ** -7}
    torch.testing.assert_close(o1, o0, **tol)
    torch.testing.assert_close(s1, s0, atol=1e-6, rtol=1e-5)
    past_length = torch.arange(T) >= case[3].unsqueeze(-1)
    assert torch.equal(s1[past_length], torch.zeros_like(s1[past_length]))
    torch.testing.assert_close(s1.sum(-1), torch.ones(B, H), atol=1e-5, rtol=0)


# the kernel's log(1 + u) casts u to float32 before it knows whether u fits (inf where not, then the other branch is
# taken): numpy, under the interpreter, warns of that cast's overflow
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["positive", "negative"])
def test_lut_attention_steep_logits_match_torch(sign):
    """Logits in the hundreds, members up to 1.7x their centre's norm: a member's logit is far above (or, on
    negative logits, below) its centre's, by up to 236 nats, more than float32's exp can take. A float32 weight
    taken against something below the row's largest logit, members included, overflows (a kernel that sums
    members' weights against their centre's logit in float32, or against the largest member norm on a negative
    logit, fails here; the Triton kernel sums them in float64, scaled); nothing may overflow or vanish, and the
    output and step match the reference's."""
    query, keys, values, lengths, slot, norm, live = layer_case(*SHAPES[2], torch.float32)
    query = query * 40 * sign
    (o0, s0), (o1, s1) = on_both_backends((query, keys, values, lengths, slot, norm, live), 64 ** -0.5)
    assert torch.isfinite(o1).all() and torch.isfinite(s1).all()
    torch.testing.assert_close(o1, o0, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s1, s0, atol=1e-5, rtol=1e-4)


def test_lut_attention_all_logits_far_below_zero_on_ragged_rows():
    """Every logit below -150, members' included (their norms above their centres': rho > 1), and rows of length
    1 to 300: key splits past a row's length hold no slot, and a combine that took 0 as their largest logit would
    weigh the real splits by exp(-150 - 0), 0 in float32."""
    query, keys, values, lengths, slot, norm, live = layer_case(*SHAPES[2], torch.float32)
    query = query.abs() * 30
    keys = -keys.abs()
    norm = torch.where(live, norm + keys.norm(dim=-1).amax(), -1.0)
    (o0, s0), (o1, s1) = on_both_backends((query, keys, values, lengths, slot, norm, live), 64 ** -0.5)
    assert (s0.amax(-1) > 0).all() and torch.isfinite(o1).all()
    torch.testing.assert_close(o1, o0, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s1, s0, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_lut_attention_deferred_step_is_the_step(backend):
    """``defer_step`` returns the output at once and the step attention as a callable (a decode step runs it on
    the layer's side stream): what the step made at once gives (to the last bits on a GPU, where the member
    weights' atomic adds run in any order, torch's scatter_add as the Triton launch), and with ``into=`` the
    addition of that same step, bit for bit."""
    case = layer_case(*SHAPES[1], torch.float32)
    with use_backend(backend):
        out, step = lut_attention(*case, 0.5, want_step=True)
        deferred_out, pending = lut_attention(*case, 0.5, want_step=True, defer_step=True)
        assert lut_attention(*case, 0.5, defer_step=True)[1] is None
    assert callable(pending)
    deferred = pending()
    torch.testing.assert_close(deferred_out, out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(deferred, step, atol=1e-6, rtol=1e-5)
    score = torch.rand_like(step)
    into = score.clone()
    assert pending(into=into) is into and torch.equal(into, score + deferred)


def test_lut_attention_without_step_returns_none():
    case = layer_case(*SHAPES[1], torch.float32)
    for backend in ("torch", "triton"):
        with use_backend(backend):
            assert lut_attention(*case, 0.5)[1] is None


@pytest.mark.parametrize("shape", SHAPES[:3] + SHAPES[4:], ids=str)
@pytest.mark.parametrize("layout", ("random", "one_centre"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_lut_attention_equals_the_expanded_view(shape, layout, dtype):
    """The reference against today's path: the view's entries (members ||k_j|| unit(k_c) with v_c), one-query
    attention over them, the step attention folded onto the stored slots. The view rounds each member key to
    the cache dtype before the dot product (the reference scales the float32 logit instead): float32 agrees to
    float32 rounding; bf16 to a 2^-8 relative error of each member's logit (a few 0.1% in its weight here: the
    step attention within 2%), the output within one bf16 rounding."""
    B, H, group, T, E, D, DV = shape
    query, keys, values, lengths, slot, norm, live = layer_case(*shape, dtype, layout)
    scaling = D ** -0.5
    with use_backend("torch"):
        out, step = lut_attention(query, keys, values, lengths, slot, norm, live, scaling, want_step=True)
        positions = torch.arange(T).expand(B, H, T).contiguous()
        view_keys, view_values, view_positions, view_slot, view_lengths = expand_lut(
            keys, values, positions, lengths, slot, live, torch.where(live, 0, -1), norm)
        view_out, view_step = decode_attention(query, view_keys, view_values, view_lengths, view_positions,
                                               torch.full((B, 1), 10 * T), scaling, T + E, want_step=True)
        view_step = fold_entries(view_step, view_slot, view_lengths, T)
    if dtype == torch.float32:
        torch.testing.assert_close(out, view_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(step, view_step, atol=1e-6, rtol=1e-5)
    else:
        torch.testing.assert_close(out, view_out, atol=1e-2, rtol=2 ** -7)
        torch.testing.assert_close(step, view_step, atol=1e-3, rtol=2e-2)


@pytest.mark.parametrize("shape", CENTRE_SHAPES, ids=str)
@pytest.mark.parametrize("bounded", [False, True], ids=["sorted", "position_map"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_lut_attention_at_centres_is_centre_slots_then_lut_attention(shape, bounded, backend):
    """Members given by their centres' positions (stored, stored only past the row's length, never stored, or
    unused; stored positions in any slot order, read through a strided view, rows of length 0 included) attend as
    ``centre_slots`` then ``lut_attention`` make them, with and without a bound. With the bound the Triton kernel
    finds the slots inside its own launches, through a map in uncleared memory (the lookup it shares with
    ``slots_through_map``, ``triton_lut_expand.mapped_centres``, is checked against maps filled with stale slots in
    ``test_position_map_needs_no_clearing``). Bit for bit, except that on a GPU the member weights' atomic adds sum
    in any order (``test_lut_attention_deferred_step_is_the_step``)."""
    B, H, T, E = shape
    positions, lengths, centre = centre_case(B, H, T, E)
    g = torch.Generator().manual_seed(3)
    group, D = 2, 16
    query = torch.randn(B, H * group, 1, D, generator=g)
    keys, values = torch.randn(B, H, T, D, generator=g) * 2, torch.randn(B, H, T, D, generator=g)
    norm = torch.rand(B, H, E, generator=g) * 3 * D ** 0.5
    limit = int(positions.max()) + 1 if bounded else None
    with use_backend(backend):
        slot, live = centre_slots(positions, lengths, centre, limit)
        out0, step0 = lut_attention(query, keys, values, lengths, slot, norm, live, D ** -0.5, want_step=True)
        for _ in range(2):  # the second call's map is likely the memory the first call's map was freed to
            out1, step1 = lut_attention_at_centres(query, keys, values, positions, lengths, centre, norm, limit,
                                                   D ** -0.5, want_step=True)
    if query.is_cuda:
        torch.testing.assert_close(out1, out0, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(step1, step0, atol=1e-6, rtol=1e-5)
    else:
        assert torch.equal(out1, out0) and torch.equal(step1, step0)
    if E > 1:
        assert bool(live.any()) and not bool(live.all())  # members whose centre is stored, and others
