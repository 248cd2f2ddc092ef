"""EMS's most redundant centres, found chunk by chunk, against the previous formulation: the whole
(TBM x centres) redundancy matrix, then its row maxima."""

from __future__ import annotations

import pytest
import torch

from kvbench.kernels.redundancy import redundancy
from kvbench.kernels.select import true_first
from kvbench.kv import LayerKV
from kvbench.methods.ems import EMS


def previous_destinations(kv, raw_keys, imp, tbm_slots, tau, similarity):
    n_imp = imp.sum(-1)
    C = int(n_imp.max())
    if C == 0 or tbm_slots.shape[-1] == 0:
        return torch.full_like(tbm_slots, -1)
    centres = true_first(imp)[..., :C]
    centre_ok = torch.arange(C).view(1, 1, -1) < n_imp.unsqueeze(-1)

    def rows(x, slots):
        return x.gather(2, slots.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))

    R = redundancy(rows(raw_keys, tbm_slots), rows(kv.values, tbm_slots), rows(raw_keys, centres),
                   rows(kv.values, centres), similarity)
    best, arg = R.masked_fill(~centre_ok.unsqueeze(2), -1.0).max(-1)
    return torch.where(best >= tau, centres.gather(-1, arg), -1)


@pytest.mark.parametrize("similarity", ["key_value", "key", "value"])
@pytest.mark.parametrize("tau", [0.0, 0.3])
def test_destinations_match_the_whole_matrix(similarity, tau):
    g = torch.Generator().manual_seed(7)
    B, H, T, D = 2, 3, 211, 16
    direction = torch.randn(B, H, 1, D, generator=g)
    raw = direction + 0.8 * torch.randn(B, H, T, D, generator=g)
    kv = LayerKV.from_dense(raw.clone(), direction + 0.8 * torch.randn(B, H, T, D, generator=g))
    kv.lengths[1, 0] = 150
    kv.zero_padding()
    method = EMS(similarity=similarity, tau=tau)
    valid = kv.valid()
    score = torch.rand(B, H, T, generator=g) * valid
    n_keep = torch.tensor([[40, 40, 3], [40, 0, 40]]).clamp(max=kv.lengths)  # a row without centres
    _, imp, tbm_slots, tbm_valid = method._partition(score, valid, kv.lengths, n_keep)
    got = method._destinations(kv, raw, imp, tbm_slots, tbm_valid)
    expected = previous_destinations(kv, raw, imp, tbm_slots, tau, similarity)
    assert torch.equal(torch.where(tbm_valid, got, -2), torch.where(tbm_valid, expected, -2))
    assert (got[tbm_valid] >= 0).sum() > 10
