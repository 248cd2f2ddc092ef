"""EMS's LUT expansion and its fold: the Triton kernels against the torch references (``kernels.lut_expand``),
on odd shapes: one stored slot, widths that are no multiple of the blocks, GQA, rows without live members,
fp32/bf16 caches, centre keys read by the kernel ("w.o. pos") or handed to it ("w. pos"); and both kernels
compiled for sm_90 without a GPU (``ptx_check_lut.py``)."""

from __future__ import annotations


import pytest
import torch

from kvbench.kernels.dispatch import use_backend
from kvbench.kernels.lut_expand import centre_slots, expand_lut, fold_entries
from tests.kernels.conftest import OUTPUT_TOLERANCE, compile_for_sm90

SHAPES = [  # B, H, T, E, D, D_v
    (1, 1, 1, 1, 4, 4),
    (2, 3, 37, 70, 12, 20),
    (1, 2, 33, 129, 64, 64),
]


def lut_case(B, H, T, E, D, DV, dtype, seed=0):
    """A random layer and LUT: ragged lengths (one row of length 1), members live at random with their centre
    in [0, length), the last row without any live member."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, T, D, generator=g).to(dtype)
    values = torch.randn(B, H, T, DV, generator=g).to(dtype)
    lengths = torch.randint(1, T + 1, (B, H), generator=g)
    lengths.view(-1)[0] = 1
    positions = torch.randperm(4 * T, generator=g)[:T].expand(B, H, T).clone()
    live = torch.rand(B, H, E, generator=g) < 0.6
    live.view(-1, E)[-1] = False
    slot = (torch.rand(B, H, E, generator=g) * lengths.unsqueeze(-1)).long()
    lut_position = torch.where(live, torch.randint(0, 4 * T, (B, H, E), generator=g), -1)
    lut_norm = torch.where(live, torch.rand(B, H, E, generator=g) * 3, -1.0)
    return keys, values, positions, lengths, slot, live, lut_position, lut_norm


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("given_keys", [False, True], ids=["centre_keys", "member_keys"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_expand_lut_triton_matches_torch(shape, given_keys, dtype):
    B, H, T, E, D, DV = shape
    case = lut_case(*shape, dtype)
    member_keys = torch.randn(B, H, E, D, generator=torch.Generator().manual_seed(3)).to(dtype) if given_keys else None
    out = {}
    for backend in ("torch", "triton"):
        with use_backend(backend):
            out[backend] = expand_lut(*case, member_keys)
    (k0, v0, p0, s0, l0), (k1, v1, p1, s1, l1) = out["torch"], out["triton"]
    lengths, live = case[3], case[5]
    assert torch.equal(l1, lengths + live.sum(-1)) and torch.equal(l0, l1)
    assert k1.shape == (B, H, T + E, D) and k1.dtype == dtype and v1.shape == (B, H, T + E, DV)
    assert torch.equal(p0, p1) and torch.equal(s0, s1) and torch.equal(v0, v1)
    atol, rtol = OUTPUT_TOLERANCE[dtype]  # one bfloat16 rounding apart at most (the module doc)
    torch.testing.assert_close(k1, k0, atol=atol, rtol=rtol)
    stored = torch.arange(T + E) < lengths.unsqueeze(-1)  # stored slots are copied bit for bit
    assert torch.equal(k1[stored], k0[stored])


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("group", [1, 3])
def test_fold_entries_triton_matches_torch(shape, group):
    B, H, T, E, D, DV = shape
    case = lut_case(*shape, torch.float32)
    with use_backend("torch"):
        _, _, _, slot, lengths = expand_lut(*case)
    g = torch.Generator().manual_seed(7)
    attended = torch.arange(T + E) < lengths.repeat_interleave(group, dim=1).unsqueeze(-1)
    stats = torch.where(attended, torch.rand(B, H * group, T + E, generator=g), 0.0)
    out = {}
    for backend in ("torch", "triton"):
        with use_backend(backend):
            out[backend] = fold_entries(stats, slot, lengths, T)
    assert out["triton"].shape == (B, H * group, T)
    torch.testing.assert_close(out["triton"], out["torch"], atol=1e-6, rtol=1e-6)  # float32 sums in any order
    torch.testing.assert_close(out["triton"].sum(-1), stats.sum(-1), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles them in KVBENCH_KERNEL_TESTS=cuda")
def test_lut_kernels_compile_for_the_gpu():
    """Every variant of the expansion, fold, centre-slot and members' attention kernels compiles to sm_90 in a
    process without TRITON_INTERPRET (``ptx_check_lut.py``)."""
    assert "25 kernel variants compiled" in compile_for_sm90("ptx_check_lut.py")


def centre_case(B, H, T, E):
    """Stored positions in any slot order (unique per row, stale values past a row's length), read through a
    strided view (a row of a larger storage), with its lengths; centres that are stored, stored only past the
    length, never stored (some past every stored position), or unused (-1). T = 300: sparse positions
    (multiples of 1024), as a long prompt's are after compression."""
    g = torch.Generator().manual_seed(11)
    storage = torch.stack([torch.randperm(4 * T + 4, generator=g)[:T + 3] for _ in range(B * H)]).view(B, H, T + 3)
    if T == 300:
        storage = storage * 1024
    positions = storage[..., :T]  # strided: every row keeps 3 more slots
    lengths = torch.randint(0, T + 1, (B, H), generator=g)
    lengths.view(-1)[0] = T
    pick = torch.randint(0, T + 3, (B, H, E), generator=g)
    centre = storage.gather(-1, pick)  # stored before, at or past the length
    kind = torch.randint(0, 4, (B, H, E), generator=g)
    centre = torch.where(kind == 0, -1, torch.where(kind == 1, 4 * T + 5 + pick, centre))  # unused; never stored
    return positions, lengths, centre


CENTRE_SHAPES = [(1, 1, 1, 1), (2, 3, 37, 70), (1, 2, 1500, 2100), (1, 2, 300, 500)]


@pytest.mark.parametrize("shape", CENTRE_SHAPES, ids=str)
@pytest.mark.parametrize("bounded", [False, True], ids=["sorted", "position_map"])
def test_centre_slots_triton_matches_torch(shape, bounded):
    """Every entry's centre slot and liveness, bit for bit, by the sort or (given a bound on the positions) the
    position map; and the reference against the definition."""
    B, H, T, E = shape
    positions, lengths, centre = centre_case(*shape)
    limit = int(positions.max()) + 1 if bounded else None  # the tightest bound: the largest position is its last
    out = {}
    for backend in ("torch", "triton"):
        with use_backend(backend):
            out[backend] = centre_slots(positions, lengths, centre, limit)
    (slot0, live0), (slot1, live1) = out["torch"], out["triton"]
    assert slot1.dtype == torch.long and live1.dtype == torch.bool
    assert torch.equal(live0, live1) and torch.equal(slot0, slot1)
    stored = torch.arange(T) < lengths.unsqueeze(-1)
    for b in range(B):
        for h in range(H):  # the definition: live iff the centre is a real slot's position, and then that slot
            where = {int(p): s for s, p in enumerate(positions[b, h].tolist()) if stored[b, h, s]}
            assert live0[b, h].tolist() == [int(c) in where for c in centre[b, h].tolist()]
            assert slot0[b, h].tolist() == [where.get(int(c), 0) for c in centre[b, h].tolist()]


@pytest.mark.parametrize("shape", CENTRE_SHAPES, ids=str)
def test_position_map_needs_no_clearing(shape):
    """The map as a decode step finds it (left by another layer or step): every entry holds a slot index that may
    be out of range, past the row's length, or a real slot that holds another position. The slots found are
    still the reference's."""
    from kvbench.kernels.triton_lut_expand import slots_through_map

    B, H, T, E = shape
    positions, lengths, centre = centre_case(*shape)
    limit = int(positions.max()) + 1
    with use_backend("torch"):
        slot0, live0 = centre_slots(positions, lengths, centre)
    g = torch.Generator().manual_seed(5)
    for low, high in ((-3, 0), (0, T + 3), (T, 2 ** 31 - 1)):
        stale = torch.randint(low, high, (B, H, limit), generator=g, dtype=torch.int32)
        slot1, live1 = slots_through_map(positions, lengths, centre, stale)
        assert torch.equal(live0, live1) and torch.equal(slot0, slot1)
