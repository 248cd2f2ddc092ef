"""merge_into_partners: hand-computed values, and the Triton twin against the torch reference on odd shapes."""

from __future__ import annotations

import pytest
import torch

from kvbench.kernels import partner_merge, triton_partner_merge
from kvbench.kernels.dispatch import use_backend


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_hand_computed_step(backend):
    # 5 real slots of 6: slot 0 (degree 3) joins slot 3, slot 2 joins slot 1; survivors 1, 3, 4 in slot order.
    keys = torch.tensor([[[[4.0], [1.0], [2.0], [0.0], [5.0], [9.0]]]])  # (1, 1, 6, 1)
    positions = torch.tensor([[[10, 11, 12, 13, 14, 0]]])
    merged = torch.tensor([[[2.0, 0.0, 0.0, 0.0, 1.0, 0.0]]])
    absorbed = torch.tensor([[[True, False, True, False, False, False]]])
    partner = torch.tensor([[[3, -1, 1, -1, -1, -1]]])
    with use_backend(backend):
        k, v, pos, deg, source = partner_merge.merge_into_partners(keys, 2 * keys, positions, merged,
                                                                   torch.tensor([[5]]), absorbed, partner, 4)
    # slot 1: (1 + 2) / 2 = 1.5, degree 2; slot 3: (3 * 4 + 0) / 4 = 3, degree 4; slot 4 alone, degree 2
    assert k.flatten().tolist() == [1.5, 3.0, 5.0, 0.0] and v.flatten().tolist() == [3.0, 6.0, 10.0, 0.0]
    assert pos.tolist() == [[[11, 13, 14, -1]]]
    assert deg.tolist() == [[[1.0, 3.0, 1.0, 0.0]]]
    assert source.tolist() == [[[1, 3, 4, 0]]]


def random_step(B, H, T, D, dtype, seed):
    """A random step shaped like CSM's: in each row, even slots may join a later odd slot of the row."""
    g = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(2))
    lengths = torch.randint(1, T + 1, (B, H), generator=g)
    slots = torch.arange(T).expand(B, H, T)
    odd_after = (slots | 1) + 2 * torch.randint(0, 3, (B, H, T), generator=g)  # an odd slot at or after
    partner = torch.where(odd_after < lengths.unsqueeze(-1), odd_after, -1)
    absorbed = (slots % 2 == 0) & (partner >= 0) & (torch.rand(B, H, T, generator=g) < 0.7)
    partner = torch.where(absorbed, partner, -1)
    merged = torch.randint(0, 4, (B, H, T), generator=g).float() * (slots < lengths.unsqueeze(-1))
    positions = torch.where(slots < lengths.unsqueeze(-1), slots * 3, -1)
    capacity = int(((slots < lengths.unsqueeze(-1)) & ~absorbed).sum(-1).max())
    return keys, values, positions, merged, lengths, absorbed, partner, capacity


# (B, H, T, D): one slot, GQA-sized heads, rows past one scan block (4096) and not multiples of the tile
SHAPES = [(1, 1, 1, 1), (2, 3, 37, 24), (1, 8, 130, 128), (2, 1, 4500, 5)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_partner_merge_matches_reference(shape, dtype, output_tolerance):
    step = random_step(*shape, dtype, seed=sum(shape))
    want = partner_merge.merge_into_partners(*step)
    got = triton_partner_merge.merge_into_partners(*step)
    assert got[0].dtype == got[1].dtype == dtype and got[0].shape == want[0].shape
    # float32 sums of a group in another order: equal to a unit in the last place of the stored dtype
    torch.testing.assert_close(got[0], want[0], **output_tolerance)
    torch.testing.assert_close(got[1], want[1], **output_tolerance)
    for exact, expected in zip(got[2:], want[2:]):  # positions, degrees (whole numbers), source slots
        assert torch.equal(exact, expected)


def test_partner_merge_keeps_strided_keys():
    keys, values, *rest = random_step(1, 4, 50, 8, torch.float32, seed=3)
    wide = torch.randn(1, 50, 4, 8).transpose(1, 2)  # (B, H, T, D) view of a (B, T, H, D) tensor
    wide.copy_(keys)
    want = partner_merge.merge_into_partners(keys, values, *rest)
    got = triton_partner_merge.merge_into_partners(wide, values, *rest)
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
