"""The merging methods' fused decode steps: each Triton kernel against its torch reference, on odd shapes.

Rows are ragged (lengths 1..C), their slots hold a shuffled order of positions (as after in-place removals),
budgets differ per batch row, and scores are small integers, so that ties are common. Every kernel must leave
the same cache as its reference: lengths and positions exactly, states exactly (D2O's threshold to float32
rounding: it is a cosine), keys and values up to one rounding of the storage dtype.
"""

from __future__ import annotations

import pytest
import torch

from kvbench.kernels import (cam_step, d2o_step, triton_cam_step, triton_d2o_step, triton_weightedkv_step,
                             weightedkv_step)
from kvbench.kernels.dispatch import use_backend

# (B, H, C, D): one slot, block-size multiples +- 1, head dims 64 and 128, a row longer than the D2O blocks
SHAPES = [(1, 1, 1, 64), (2, 3, 7, 64), (2, 2, 65, 128), (1, 4, 300, 64), (3, 1, 129, 128)]


def storage(B, H, C, D, S, dtype, seed):
    """Ragged rows in shuffled slot order; sinks hold the first positions in the first slots (as prefill leaves
    them); states (S, B, H, C) of small non-negative integers and halves."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, C + 1, (B, H), generator=g)
    lengths[0, 0] = C
    positions = 2 + torch.stack([torch.randperm(C, generator=g) for _ in range(B * H)]).view(B, H, C) * 2
    positions[..., :min(C, 2)] = torch.arange(min(C, 2))
    return dict(keys=torch.randn(B, H, C, D, generator=g).to(dtype),
                values=torch.randn(B, H, C, D, generator=g).to(dtype),
                positions=positions, lengths=lengths,
                state=torch.randint(0, 7, (S, B, H, C), generator=g).float() / 2,
                n_keep=torch.randint(1, C + 1, (B,), generator=g))


def assert_same_cache(got, want, output_tolerance, state_tolerance=0.0):
    for name in ("lengths", "positions"):
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    torch.testing.assert_close(got["state"], want["state"], rtol=state_tolerance, atol=state_tolerance,
                               equal_nan=True, msg="state")
    for name in ("keys", "values"):
        torch.testing.assert_close(got[name].float(), want[name].float(), **output_tolerance, msg=name)


def run_both(reference, kernel, make, call):
    """``call(step, cache)`` with the reference and with the kernel, each on its own ``make()``; returns
    (kernel's cache, reference's cache)."""
    want, got = make(), make()
    with use_backend("torch"):
        call(reference, want)
    call(kernel, got)
    return got, want


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("recent", [None, 0, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_weightedkv_step_matches_reference(shape, recent, seed, dtype, output_tolerance):
    def make():
        s = storage(*shape, 3, dtype, seed)
        s["state"][1] = s["state"][1].round()  # n: observations, some 0 (never observed)
        return s

    def call(step, s):
        step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], s["state"][0], s["state"][1],
             s["n_keep"], 2, recent)

    got, want = run_both(weightedkv_step.weightedkv_step, triton_weightedkv_step.weightedkv_step, make, call)
    assert_same_cache(got, want, output_tolerance)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("eviction,merge_tokens,key", [(None, 16, 0), (0.5, 4, 2**32 - 5), (0.3, 5, None),
                                                      (None, 3, None)],
                         ids=["streamingllm", "h2o_n4", "h2o_0.3_deterministic", "streamingllm_deterministic"])
def test_cam_step_matches_reference(shape, eviction, merge_tokens, key, dtype, output_tolerance):
    def call(step, s):
        step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], s["state"][1], s["n_keep"], 2,
             eviction, merge_tokens, key)

    got, want = run_both(cam_step.cam_step, triton_cam_step.cam_step, lambda: storage(*shape, 2, dtype, 3), call)
    assert_same_cache(got, want, output_tolerance)


def test_cam_draws_are_the_reference_draws():
    """The kernel's hash reproduces ``uniform_draws`` bit for bit: with merge probabilities strictly between 0
    and 1 the draw decides, over many rows, heads and layer keys (the largest ones do not fit an int32)."""
    B, H, C, D = 8, 4, 24, 8
    for key in (0, 1, 12345, 2**31 + 7, 2**32 - 1):
        def make():
            s = storage(B, H, C, D, 2, torch.float32, 5)
            s["lengths"][:] = C
            s["n_keep"][:] = C - 1
            s["state"][1] = torch.where(s["positions"] % 4 == 0, 1.0, 0.5)  # p_e = 0.5 / 0.67 for most e
            return s

        def call(step, s):
            step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], s["state"][1], s["n_keep"], 1,
                 0.75, 3, key)

        got, want = run_both(cam_step.cam_step, triton_cam_step.cam_step, make, call)
        torch.testing.assert_close(got["values"], want["values"], rtol=0, atol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("layer_scope,weighted", [(False, True), (True, False), (True, True)],
                         ids=["head_weighted", "layer_code_mean", "layer_weighted"])
@pytest.mark.parametrize("seed", [0, 1])
def test_d2o_step_matches_reference(shape, layer_scope, weighted, seed, dtype, output_tolerance):
    def make():
        s = storage(*shape, 3, dtype, seed)
        B, H, C, D = shape
        s["state"][2] = torch.where(torch.arange(B).view(B, 1, 1) == 0, float("nan"), 0.3).expand(B, H, C)
        # keys along one axis: their cosines with any key are equal in any summation order (exact ties, which
        # go to the oldest position; duplicates of a general key would tie only up to the BLAS's rounding)
        s["keys"][..., 1::3, :] = 0
        s["keys"][..., 1::3, 0] = 2.0
        s["state"][1, ..., 1::3] = 0  # the lowest attention: the victim is one of them, and its best matches tie
        return s

    def call(step, s):
        step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], s["state"][1], s["state"][2],
             s["n_keep"], 3, 1, 2, 0.7, layer_scope, weighted)

    got, want = run_both(d2o_step.d2o_step, triton_d2o_step.d2o_step, make, call)
    assert_same_cache(got, want, output_tolerance, state_tolerance=1e-6)  # the threshold follows the cosines
