"""Chelsea's host-planned steps: the plan's edge and merge counts are the device's, and compress returns exactly
what the previous formulation (every step reading its counts back from the device) returned."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbench.kernels.matching import chunked_soft_matching
from kvbench.kernels.merge import group_sum, scatter_merge
from kvbench.kernels.select import topk_mask, true_first
from kvbench.kv import LOGIT_BIAS, AttentionStats, LayerKV
from kvbench.methods.chelsea import MERGED, Chelsea
from kvbench.methods.chelsea_schedule import plan_steps


def random_case(seed: int):
    """A ragged layer, a budget and a Chelsea configuration drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    B, H, T, D = int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.choice([1, 2, 9, 40, 131])), 8
    kv = LayerKV.from_dense(torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g))
    kv.lengths = torch.randint(1, T + 1, (B, H), generator=g)
    kv.zero_padding()
    method = Chelsea(sinks=int(rng.choice([0, 2, 16])), recent=int(rng.choice([0, 3, 64])),
                     chunk_size=[2, 5, 16, 256, None][int(rng.integers(5))], r0=float(rng.choice([0.5, 0.3, 0.1])),
                     r_decay=float(rng.choice([0.0, 0.1])), r_steps=int(rng.choice([0, 2])), r_min=0.05)
    return kv, torch.randint(1, T + 1, (B,), generator=g), method


@pytest.mark.parametrize("seed", range(40))
def test_planned_counts_are_the_devices(seed):
    kv, n_keep, method = random_case(seed)
    lengths = kv.lengths.numpy()
    target = np.broadcast_to(n_keep.numpy()[:, None], lengths.shape)
    for step in plan_steps(lengths, target, method.sinks, method.recent, method.chunk_size, method.ratio):
        start, region = torch.from_numpy(step.start), torch.from_numpy(step.region)
        _, similarity = chunked_soft_matching(kv.keys, start, region, method.chunk_size)
        assert np.array_equal(torch.isfinite(similarity).sum(-1).numpy(), step.edges)
        assert np.array_equal(topk_mask(similarity, torch.from_numpy(step.merges)).sum(-1).numpy(), step.merges)


def previous_compress(method: Chelsea, kv: LayerKV, n_keep: torch.Tensor) -> LayerKV:
    """Chelsea.compress as it was before the host plan (main at bbd6307, no outlier heads): each step computes
    its counts on the device and reads them back, and merges through group_sum / scatter_merge / gather."""
    kv.state.setdefault(MERGED, torch.zeros(kv.positions.shape))
    target, step = n_keep.view(-1, 1).expand_as(kv.lengths), 0
    while bool((kv.lengths > target).any()):
        recent = torch.minimum(torch.full_like(target, method.recent), target - 1)
        sinks = torch.minimum(torch.full_like(target, method.sinks), target - 1 - recent)
        region = (kv.lengths - sinks - recent).clamp(min=0)
        partner, similarity = chunked_soft_matching(kv.keys, sinks, region, method.chunk_size)
        per_step = torch.floor(method.ratio(step) * region.double()).long().clamp(min=1)
        absorbed = topk_mask(similarity, torch.minimum((kv.lengths - target).clamp(min=0), per_step))
        valid = kv.valid()
        survivor = valid & ~absorbed
        rank = survivor.long().cumsum(-1) - 1
        slots = torch.arange(kv.capacity).expand_as(rank)
        groups = torch.where(valid, rank.gather(2, torch.where(absorbed, partner, slots)), -1)
        lengths = survivor.sum(-1)
        G = int(lengths.max())
        degree = (kv.state[MERGED] + 1) * valid
        cluster_degree = group_sum(degree, groups, G)
        weight = degree / cluster_degree.gather(2, groups.clamp(min=0)).clamp(min=1)
        merged = kv.gather(true_first(survivor)[..., :G], lengths)
        merged.keys = scatter_merge(kv.keys, groups, weight, G)
        merged.values = scatter_merge(kv.values, groups, weight, G)
        merged.state[MERGED] = cluster_degree - 1
        merged.zero_padding()
        kv, step = merged, step + 1
    kv.state[LOGIT_BIAS] = torch.log1p(kv.state[MERGED])
    return kv


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_compress_equals_the_previous_formulation(seed, phase):
    kv, n_keep, method = random_case(seed)
    if phase == "decode":  # slots already merged once, and the bias of that earlier call (it follows its slot)
        kv.state[MERGED] = torch.randint(0, 3, kv.positions.shape, generator=torch.Generator().manual_seed(seed))
        kv.state[MERGED] = kv.state[MERGED].float() * kv.valid()
        kv.state[LOGIT_BIAS] = torch.log1p(kv.state[MERGED])

    def copy() -> LayerKV:
        return LayerKV(kv.keys.clone(), kv.values.clone(), kv.positions.clone(), kv.lengths.clone(),
                       state={name: s.clone() for name, s in kv.state.items()})

    got, want = method.compress(0, copy(), AttentionStats(), n_keep, phase), previous_compress(method, copy(), n_keep)
    assert torch.equal(got.lengths, want.lengths) and set(got.state) == set(want.state)
    for name in ("keys", "values", "positions"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name, state in want.state.items():
        assert torch.equal(got.state[name], state), name
