"""The merging methods' fused decode steps: each Triton kernel against its torch reference, on odd shapes.

Rows are ragged (lengths 1..C), their slots hold a shuffled order of positions (as after in-place removals),
budgets differ per batch row, and scores are small integers, so that ties are common. Every kernel must leave
the same cache as its reference: lengths and positions exactly, states exactly (D2O's threshold to float32
rounding: it is a cosine), keys and values up to one rounding of the storage dtype.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import kvbench.kernels

from kvbench.attention import Rope
from kvbench.kernels import (cam_step, d2o_step, ems_step, observe, triton_cam_step, triton_d2o_step, triton_decode,
                             triton_ems_step, triton_observe, triton_slots, triton_weightedkv_step, weightedkv_step)
from kvbench.kernels.d2o_step import protection
from kvbench.kernels.dispatch import use_backend
from kvbench.kv import AttentionStats, LayerKV
from tests.kernels.conftest import MODE, compile_for_sm90
from tests.test_decode_paths import CASES, build, compare_under_random_attention

# (B, H, C, D): one slot, block-size multiples +- 1, head dims 64 and 128, rows split into several blocks
SHAPES = [(1, 1, 1, 64), (2, 3, 7, 64), (2, 2, 65, 128), (1, 4, 300, 64), (3, 1, 129, 128)]
# every shape in float32, the multi-block ones in bfloat16 too (the interpreter makes each case cost seconds); on a
# GPU (KVBENCH_KERNEL_TESTS=cuda) each case compiles its own variants, so two layouts cover the compiled kernels
LAYOUTS = pytest.mark.parametrize("shape,dtype", [(SHAPES[2], torch.float32), (SHAPES[3], torch.bfloat16)]
                                  if MODE == "cuda" else [(shape, torch.float32) for shape in SHAPES]
                                  + [(shape, torch.bfloat16) for shape in SHAPES[2:4]], ids=str)


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


@LAYOUTS
@pytest.mark.parametrize("recent,seed", [(None, 0), (0, 1), (3, 2)])
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


@pytest.mark.parametrize("recent", [None, 3])
def test_weightedkv_step_over_blocks_matches_reference(recent):
    """Rows longer than a block (three a row here): the lowest merge key, the newest position and the next position
    after the merged slot are found block by block and folded; the same merge and move as the reference."""
    def make():
        s = storage(1, 2, 2500, 16, 3, torch.float32, 6)
        s["state"][1] = s["state"][1].round()  # n: observations, some 0 (never observed)
        return s

    def call(step, s):
        step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], s["state"][0], s["state"][1],
             s["n_keep"], 2, recent)

    assert triton_slots.row_blocks(2, 2500, triton_slots.BLOCK_SCAN, torch.device("cpu"))[0] == 3
    got, want = run_both(weightedkv_step.weightedkv_step, triton_weightedkv_step.weightedkv_step, make, call)
    assert_same_cache(got, want, {"atol": 1e-6, "rtol": 1e-6})


def _step_call(name: str, recent: int | None):
    """``call(step, s, **extra)`` of the decode step of ``name`` on ``storage``'s rows (``ems_storage``'s for EMS):
    WeightedKV (``recent``), CaM under H2O's rule with the draw (``recent`` unused), D2O, EMS (tau 0: every TBM
    merges)."""
    def call(step, s, **extra):
        if name == "weightedkv":
            step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], s["state"][0], s["state"][1],
                 s["n_keep"], 2, recent, **extra)
        elif name == "cam":
            step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], s["state"][1], s["n_keep"], 2,
                 0.5, 4, 2**32 - 5, **extra)
        elif name == "d2o":
            step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], s["state"][1], s["state"][2],
                 s["n_keep"], 2, 3, 1, 0.5, False, True, **extra)
        else:
            step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], s["raw_keys"],
                 tuple(s["state"][:3]), (s["state"][3], s["state"][4], None), s["lut"], s["n_keep"], 3, 0.0, 4.0,
                 "key_value", False, **extra)
    return call


STEPS = {"weightedkv": (weightedkv_step.weightedkv_step, triton_weightedkv_step.weightedkv_step),
         "cam": (cam_step.cam_step, triton_cam_step.cam_step), "d2o": (d2o_step.d2o_step, triton_d2o_step.d2o_step),
         "ems": (ems_step.ems_step, triton_ems_step.ems_step)}


@pytest.mark.parametrize("name,recent", [("weightedkv", None), ("weightedkv", 3), ("cam", None), ("d2o", None)])
def test_steps_read_the_newest_from_the_last_slot_where_told(name, recent):
    """``newest_last`` (a decode step's rows, whose last real slot holds the token the step appended): the Triton
    steps read each row's newest position there instead of scanning their blocks, with the same merge and move as
    the reference's maximum over the row, on rows in shuffled slot order over three blocks."""
    def make():
        s = storage(1, 2, 2500, 16, 3, torch.float32, 7)
        s["state"][1] = s["state"][1].round()
        if name == "d2o":
            s["state"][2] = float("nan")  # no threshold yet
        for h in range(2):  # each row's newest position into its last real slot
            last = int(s["lengths"][0, h]) - 1
            row = s["positions"][0, h]
            newest = int(row[:last + 1].argmax())
            row[[newest, last]] = row[[last, newest]]
        return s

    reference, kernel = STEPS[name]
    call = _step_call(name, recent)  # the reference takes the row's maximum either way
    got, want = run_both(reference, kernel, make, lambda step, s: call(step, s, newest_last=True))
    if name == "d2o":  # the merge and the threshold follow the cosines (test_d2o_step_over_blocks_matches_reference)
        assert_same_cache(got, want, {"atol": 1e-5, "rtol": 1e-5}, state_tolerance=1e-6)
    else:
        assert_same_cache(got, want, {"atol": 1e-6, "rtol": 1e-6})


@LAYOUTS
@pytest.mark.parametrize("eviction,merge_tokens,key", [(None, 16, 0), (0.5, 4, 2**32 - 5), (0.3, 5, None),
                                                      (None, 3, None)],
                         ids=["streamingllm", "h2o_n4", "h2o_0.3_deterministic", "streamingllm_deterministic"])
def test_cam_step_matches_reference(shape, eviction, merge_tokens, key, dtype, output_tolerance):
    def call(step, s):
        step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], s["state"][1], s["n_keep"], 2,
             eviction, merge_tokens, key)

    got, want = run_both(cam_step.cam_step, triton_cam_step.cam_step, lambda: storage(*shape, 2, dtype, 3), call)
    assert_same_cache(got, want, output_tolerance)


@pytest.mark.parametrize("eviction,key", [(None, 3), (0.5, None)], ids=["streamingllm", "h2o_deterministic"])
def test_cam_step_over_blocks_matches_reference(eviction, key):
    """Rows longer than a block: the evicted slot and its n next positions are found block by block (three blocks
    a row here) and folded, the n next spread over several blocks; the same slots and merges as the reference."""
    def call(step, s):
        step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], s["state"][1], s["n_keep"], 2,
             eviction, 16, key)

    assert triton_slots.row_blocks(2, 2500, triton_slots.BLOCK_SCAN, torch.device("cpu"))[0] == 3
    got, want = run_both(cam_step.cam_step, triton_cam_step.cam_step,
                         lambda: storage(1, 2, 2500, 16, 2, torch.float32, 4), call)
    assert_same_cache(got, want, {"atol": 1e-6, "rtol": 1e-6})


def test_cam_draws_are_the_reference_draws():
    """The kernel's hash reproduces ``uniform_draws`` bit for bit: with merge probabilities strictly between 0
    and 1 the draw decides, over many rows, heads and layer keys (the largest ones do not fit an int32)."""
    B, H, C, D = 8, 4, 24, 8
    for key in (1, 2**31 + 7, 2**32 - 1):
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


@LAYOUTS
@pytest.mark.parametrize("layer_scope,weighted,seed", [(False, True, 0), (True, False, 1), (True, True, 2)],
                         ids=["head_weighted", "layer_code_mean", "layer_weighted"])
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


@pytest.mark.parametrize("layer_scope", [False, True], ids=["head", "layer"])
def test_d2o_step_over_blocks_matches_reference(layer_scope):
    """Rows longer than the victim's block (three a row here): the newest position and the lowest attention found
    block by block and folded, ties among them (attention in halves) falling in any block; the same victim,
    match and merge as the reference."""
    def make():
        s = storage(1, 2, 2500, 16, 3, torch.float32, 8)
        s["state"][2] = 0.3
        return s

    def call(step, s):
        step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], s["state"][1], s["state"][2],
             s["n_keep"], 3, 1, 2, 0.7, layer_scope, True)

    assert triton_slots.row_blocks(2, 2500, triton_slots.BLOCK_SCAN, torch.device("cpu"))[0] == 3
    got, want = run_both(d2o_step.d2o_step, triton_d2o_step.d2o_step, make, call)
    assert_same_cache(got, want, {"atol": 1e-5, "rtol": 1e-5}, state_tolerance=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("ties", [False, True], ids=["general", "ties"])
@pytest.mark.parametrize("head_dim", [32, 128])
def test_d2o_streamed_match_gives_the_match_kernels_bits(dtype, ties, head_dim, monkeypatch):
    """The best match streamed (large batches: the next tile loaded ahead, a best per lane folded once) and the
    match kernel's fold tile by tile: the same victim's cosines, match and merge, bit for bit, exact ties
    among the matches included (keys along one axis) and ragged rows. On a GPU the bits hold while both kernels
    sum in the same layouts (tests/kernels/ptx_check.py), which ``streamed_match`` sees to: head dim 32 is the
    smallest it streams in bf16 (at 16 the cosines differed by an ulp on an H200)."""
    assert triton_d2o_step.streamed_match(triton_d2o_step.STREAMED_MIN_SPAN, head_dim, dtype.itemsize)

    def make():
        s = storage(3, 2, 700, head_dim, 3, dtype, 5)
        s["state"][2] = 0.3
        if ties:
            s["keys"][..., 1::3, :] = 0
            s["keys"][..., 1::3, 0] = 2.0
            s["state"][1, ..., 1::3] = 0
        return s

    def call(min_span):
        monkeypatch.setattr(triton_d2o_step, "STREAMED_MIN_SPAN", min_span)
        s = make()
        triton_d2o_step.d2o_step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], s["state"][1],
                                 s["state"][2], s["n_keep"], 3, 1, 2, 0.7, False, True)
        return s

    streamed, tiled = call(0), call(2**62)
    assert triton_slots.row_blocks(6, 700, triton_d2o_step.BLOCK_S, torch.device("cpu"))[1] > 2 * 32
    assert_same_cache(streamed, tiled, {"atol": 0, "rtol": 0})


@pytest.mark.parametrize("layer_scope", [False, True], ids=["head", "layer"])
def test_d2o_step_with_the_pending_step_attention_fused(layer_scope):
    """D2O's step given the pass's pending step attention (``triton_decode.PendingStep``) makes it inside its
    first launch: the accumulated attention, the victim, the merge and the threshold are, bit for bit, those
    of the step attention's own launch followed by the step. Rows span several of the step launch's blocks;
    the lowest attention sits on the protected slots, and the victim on either edge of the protection: the
    first slot after the sinks, or the newest position outside the recent window (ties among the rest)."""
    B, H, group, C, n_heavy, n_recent, n_sinks = 2, 2, 3, 2500, 3, 1, 2

    def make():
        s = storage(B, H, C, 16, 3, torch.float32, 11)
        s["state"][2] = 0.3
        s["lengths"] = torch.tensor([[2500, 1900], [1200, 1500]])
        s["n_keep"] = torch.tensor([900, 1400])
        g = torch.Generator().manual_seed(12)
        for b in range(B):
            for h in range(H):  # positions 0..L-1: the sinks first, the newest last (as after a one-query pass)
                L = int(s["lengths"][b, h])
                s["positions"][b, h, :L] = torch.cat([torch.arange(2), 2 + torch.randperm(L - 3, generator=g),
                                                      torch.tensor([L - 1])])
                _, recent = protection(torch.tensor(min(int(s["n_keep"][b]), L)), n_heavy, n_recent, n_sinks)
                recent = int(recent)
                pos, att = s["positions"][b, h, :L], s["state"][1, b, h, :L]
                att[:n_sinks] = -100.0
                att[pos > L - 1 - recent] = -100.0
                att[5::7] = -50.0  # ties, to the oldest position
                if (b + h) % 2 == 0:  # the victim: the first slot after the sinks, holding the oldest free position
                    edge, oldest_free = n_sinks, int((pos == n_sinks).nonzero())
                    pos[[edge, oldest_free]] = pos[[oldest_free, edge]]
                else:  # the victim: the newest position outside the recent window
                    edge = int((pos == L - 1 - recent).nonzero())
                att[edge] = -60.0
        logits = torch.randn(B, H * group, C, generator=g) * 3
        logits[..., C - 7:] = float("-inf")
        s["step"] = triton_decode.PendingStep(logits, torch.randn(B, H * group, generator=g), group, C - 3)
        return s

    def call(s, fused):
        step = s["step"]
        if not fused:
            step(into=s["state"][1])
        triton_d2o_step.d2o_step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], s["state"][1],
                                 s["state"][2], s["n_keep"], n_heavy, n_recent, n_sinks, 0.7, layer_scope, True,
                                 newest_last=True, step=step if fused else None)
        return s

    assert C > 2 * triton_decode.STEP_BLOCK
    assert_same_cache(call(make(), True), call(make(), False), {"atol": 0, "rtol": 0})


# (tau, gamma, similarity, lut, with_positions, logit bias): every TBM merges, eviction only, gamma = inf,
# gamma just above 1 (a TBM share only for budgets >= 5), and each key rule (lut, bias with/without positions)
EMS_RULES = [(0.0, 4.0, "key_value", True, False, False), (0.5, 1.0, "key_value", True, False, False),
             (0.2, float("inf"), "key", True, True, False), (0.0, 1.1, "value", True, False, False),
             (0.0, 4.0, "key_value", False, True, True), (0.0, 2.0, "key", False, False, True),
             (0.0, 3.0, "value", False, False, False)]


def ems_storage(shape, dtype, seed, lut, bias, entries):
    """``storage`` with EMS's states (s_glo, s_loc_past, s_loc_cur, merged_mass, merged_tokens, logit_bias),
    raw keys, and look-up tables: members at odd positions (older and newer than the row's slots), centred on
    the row's stored positions, some rows' tables full."""
    s = storage(*shape, 6, dtype, seed)
    B, H, C, D = shape
    g = torch.Generator().manual_seed(seed + 100)
    s["state"][:3] = torch.rand(3, B, H, C, generator=g)
    s["state"][4] = s["state"][4].round()
    s["raw_keys"] = torch.randn(B, H, C, D, generator=g).to(dtype)
    if lut:
        member = torch.stack([torch.randperm(3 * C + entries, generator=g)[:entries] for _ in range(B * H)])
        position = (member.view(B, H, entries) * 2 + 3)
        stored = torch.randint(0, C, (B, H, entries), generator=g) % s["lengths"].unsqueeze(-1)
        centre = s["positions"].gather(2, stored)
        unused = torch.rand(B, H, entries, generator=g) < torch.rand(B, H, 1, generator=g).round() * 0.5
        s["lut"] = (torch.where(unused, -1, position), torch.where(unused, -1, centre),
                    torch.where(unused, -1.0, torch.rand(B, H, entries, generator=g) + 0.5))
    return s


@LAYOUTS
@pytest.mark.parametrize("rule", EMS_RULES, ids=str)
def test_ems_step_matches_reference(shape, rule, dtype, output_tolerance):
    tau, gamma, similarity, lut, with_positions, bias = rule

    def call(step, s):
        merges = (s["state"][3], s["state"][4], s["state"][5] if bias else None)
        step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], s["raw_keys"], tuple(s["state"][:3]),
             merges, s.get("lut"), s["n_keep"], 3, tau, gamma, similarity, with_positions)

    got, want = run_both(ems_step.ems_step, triton_ems_step.ems_step,
                         lambda: ems_storage(shape, dtype, 7, lut, bias, entries=11), call)
    assert_same_cache(got, want, output_tolerance, state_tolerance=1e-6)  # scores and logs round differently
    if lut:
        for name, got_table, want_table in zip(("position", "centre", "norm"), got["lut"], want["lut"]):
            torch.testing.assert_close(got_table, want_table, msg=name)


@pytest.mark.parametrize("name", ["d2o", "ems"])
def test_best_match_ties_go_to_the_oldest_position_within_and_across_tiles(name):
    """Every key (and EMS's every value) along one axis: every cosine is exactly 1, so the tie rule alone picks the
    match, the oldest eligible position, among shuffled slots over blocks of several tiles. The Triton scans fold
    every tile across its slots and the tiles in order, so ties meet inside a tile, across tiles and across blocks
    (and a scan that kept a best per lane, folding the lanes after the loop, would meet them inside a lane and
    across lanes: the lane-fold variant timed on 2026-11-29 reversed the rule there, and this test caught it)."""
    shape = (1, 2, 600, 16)
    assert triton_slots.row_blocks(2, 600, triton_d2o_step.BLOCK_S, torch.device("cpu"))[1] >= 3 * 64

    def make():
        s = ems_storage(shape, torch.float32, 5, True, False, entries=11) if name == "ems" else (
            storage(*shape, 3, torch.float32, 5))
        for tensor in (s["raw_keys"], s["values"]) if name == "ems" else (s["keys"],):
            tensor.zero_()
            tensor[..., 0] = 2.0
        if name == "d2o":
            s["state"][2] = float("nan")
        return s

    reference, kernel = STEPS[name]
    got, want = run_both(reference, kernel, make, _step_call(name, None))
    assert_same_cache(got, want, {"atol": 1e-5, "rtol": 1e-5}, state_tolerance=1e-6)


def llama3_rope(head_dim: int, context: int = 131072) -> Rope:
    """Llama 3.1's RoPE (theta 500,000, llama3 frequency scaling) at ``head_dim``, on the default device; ``context``:
    the positions its table holds."""
    config = LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
                         max_position_embeddings=context,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192})
    return Rope(SimpleNamespace(config=config, model=SimpleNamespace(rotary_emb=LlamaRotaryEmbedding(config).to(
        torch.get_default_device()))))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("rule", [EMS_RULES[0], EMS_RULES[4]], ids=str)
@pytest.mark.parametrize("context", [131072, 99950], ids=["table", "past_the_table"])
def test_ems_step_unrotates_the_keys_it_reads(dtype, rule, context, output_tolerance):
    """With the model's RoPE instead of raw keys (``raw_keys=None``), the Triton step takes RoPE off the stored keys
    of the slots it reads (16-bit keys) or off every slot (float32), at positions near 100k (large angles), and
    leaves the reference's cache; in registers it rounds the raw keys as ``Rope.unrotate`` does, so the step is the
    step given those raw keys, to the bit, with cos and sin from the model's table or, for tiles holding a position
    past it, computed (float16 only on a GPU there: the interpreter's cosine is numpy's, whose float32 last bit
    differs from torch's often enough to show through float16's rounding)."""
    tau, gamma, similarity, lut, with_positions, bias = rule
    shape = (2, 2, 65, 64)
    rope = llama3_rope(shape[-1], context)

    def make():
        s = ems_storage(shape, dtype, 7, lut, bias, entries=11)
        s["positions"] += 100000 - 2 * shape[2] - 2
        if lut:
            s["lut"] = tuple(torch.where(t >= 0, t + 100000 - 2 * shape[2] - 2, t) if i < 2 else t
                             for i, t in enumerate(s["lut"]))
        return s

    def call(step, s, raw_keys=None):
        merges = (s["state"][3], s["state"][4], s["state"][5] if bias else None)
        step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], raw_keys, tuple(s["state"][:3]),
             merges, s.get("lut"), s["n_keep"], 3, tau, gamma, similarity, with_positions, rope)

    got, want = run_both(ems_step.ems_step, triton_ems_step.ems_step, make, call)
    assert_same_cache(got, want, output_tolerance, state_tolerance=1e-6)
    if dtype == torch.float16 and context < 131072 and MODE != "cuda":
        return
    given = make()
    call(triton_ems_step.ems_step, given, rope.unrotate(given["keys"], given["positions"]))
    for name in ("keys", "values", "positions", "lengths", "state"):
        assert torch.equal(got[name], given[name]), name
    for got_table, given_table in zip(got.get("lut", ()), given.get("lut", ())):
        assert torch.equal(got_table, given_table)


@pytest.mark.parametrize("shape", [*SHAPES, (1, 2, 2500, 8)], ids=str)  # the last: rows of three blocks
@pytest.mark.parametrize("queries", [None, "per_row"])
def test_observe_pass_matches_reference(shape, queries):
    def make():
        s = storage(*shape, 2, torch.float32, 11)
        s["attention"] = torch.rand(shape[:3], generator=torch.Generator().manual_seed(3))
        s["queries"] = None if queries is None else torch.arange(1, shape[0] + 1) * 2
        return s

    def call(step, s):
        step(s["state"][0], s["state"][1], s["attention"], s["positions"], s["lengths"], s["queries"])

    got, want = run_both(observe.observe_pass, triton_observe.observe_pass, make, call)
    torch.testing.assert_close(got["state"], want["state"], rtol=0, atol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("window", [1, 3, 32])
def test_ems_observe_matches_reference(shape, window):
    def make():
        s = storage(*shape, 4, torch.float32, 12)
        g = torch.Generator().manual_seed(4)
        s["state"][:3] = torch.rand(3, *shape[:3], generator=g)
        s["state"][3] = torch.randint(0, 4, (*shape[:2], 1), generator=g).float().expand(shape[:3])
        s["attention"] = torch.rand(shape[:3], generator=g)
        return s

    def call(step, s):
        step(*s["state"], s["attention"], s["lengths"], window)

    got, want = run_both(ems_step.ems_observe, triton_ems_step.ems_observe, make, call)
    torch.testing.assert_close(got["state"], want["state"], rtol=0, atol=0)


@pytest.mark.parametrize("op", ["weightedkv", "cam", "d2o", "ems"])
def test_rows_longer_than_a_tile(op):
    """Rows of more slots than one tile of a row scan (8192) and a look-up table of more entries than one of
    its tiles (4096): every loop of the kernels takes several tiles."""
    shape = (1, 2, 9000, 16)
    if op == "ems":
        def call(step, s):
            step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], s["raw_keys"],
                 tuple(s["state"][:3]), (s["state"][3], s["state"][4], None), s["lut"], s["n_keep"], 3, 0.0, 4.0,
                 "key_value", False)

        make, kernels = (lambda: ems_storage(shape, torch.float32, 5, True, False, entries=5000),
                         (ems_step.ems_step, triton_ems_step.ems_step))
    else:
        def call(step, s):
            rows = {"weightedkv": (s["state"][0], s["state"][1], s["n_keep"], 2, None),
                    "cam": (s["state"][1], s["n_keep"], 2, 0.5, 16, 7),
                    "d2o": (s["state"][1], s["state"][2], s["n_keep"], 3, 1, 2, 0.7, False, True)}[op]
            step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], *rows)

        def make():
            s = storage(*shape, 3, torch.float32, 6)
            return s

        module = {"weightedkv": weightedkv_step, "cam": cam_step, "d2o": d2o_step}[op]
        triton_module = {"weightedkv": triton_weightedkv_step, "cam": triton_cam_step, "d2o": triton_d2o_step}[op]
        kernels = (getattr(module, f"{op}_step"), getattr(triton_module, f"{op}_step"))
    got, want = run_both(*kernels, make, call)
    assert_same_cache(got, want, {"atol": 1e-5, "rtol": 1e-5}, state_tolerance=1e-6)


class Launches(TorchDispatchMode):
    """Counts what one call issues to the device: Triton kernel launches (every kernel of the kvbench.kernels
    modules is wrapped), and the torch operators called outside them (the interpreter's own copies of a
    launch's arguments are not the caller's)."""

    def __init__(self, monkeypatch) -> None:
        super().__init__()
        self.kernels: list[str] = []
        self.torch_ops: list[str] = []
        self._inside = False
        for info in pkgutil.iter_modules(kvbench.kernels.__path__, "kvbench.kernels."):
            if info.name.rsplit(".", 1)[-1].startswith("triton_"):
                for name, fn in vars(importlib.import_module(info.name)).items():
                    if hasattr(fn, "run") and hasattr(fn, "fn"):
                        monkeypatch.setattr(fn, "run", self._counted(name, fn.run))

    def _counted(self, name, run):
        def launch(*args, **kwargs):
            self.kernels.append(name)
            self._inside = True
            try:
                return run(*args, **kwargs)
            finally:
                self._inside = False
        return launch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._inside and not func.is_view:  # a view (an expand) is no device work
            self.torch_ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name,launches", [("streamingllm", 2), ("h2o", 4), ("tova", 5), ("cam", 4), ("cam_h2o", 4),
                                           ("weightedkv", 4), ("d2o", 4), ("d2o_layer_threshold", 4), ("ems", 5),
                                           ("ems_bias", 4), ("ems_from_rope", 6)])
def test_fused_decode_step_issues_one_to_six_operations(monkeypatch, name, launches):
    """One decode step of one layer (``observe`` then ``evict_one``) with the Triton backend, on the engine's
    decode storage: the device runs its kernels and nothing else but scratch allocations (the torch path issues
    ~10-300 operations). Observations: H2O's, CaM's and D2O's one torch addition, EMS's one launch, WeightedKV's
    one (its blocks' updates: one query a row needs no newest position, ``AttentionStats.one_query``).
    Steps that split each row over blocks, a launch per phase: StreamingLLM's two (each block's lowest under the
    budget, the fold and move), H2O's three (the blocks' newest positions first), TOVA's three after its head
    average and a zero protection. After a one-query pass the row's newest position is its last slot's, so no
    launch finds it for CaM's three (the lowest, the next positions, the merge and move), WeightedKV's three (the
    lowest merge key, the next position, the merge and move) or D2O's three (the lowest attention, the best
    match, the merge). EMS's step: three launches (a row's scans, the
    block-split best match, the merge; its look-up table a fourth).
    ``ems_from_rope``: EMS's step handed the model's RoPE instead of raw keys, as the engine hands it for 16-bit keys:
    its kernels take RoPE off the keys they read and no un-RoPE'd copy of the cache is made, phase 2 running twice
    (the second for blocks past the RoPE table); with float32 keys ``Rope.unrotate`` would run as torch operations
    first."""
    from_rope = name == "ems_from_rope"
    method = build("ems" if from_rope else name)
    dtype = torch.bfloat16 if from_rope else torch.float32
    g = torch.Generator().manual_seed(0)
    B, H, D, prompt = 2, 2, 8, 30
    n_keep = torch.tensor([12, 9])
    kv = LayerKV.from_dense(torch.randn(B, H, prompt, D, generator=g).to(dtype),
                            torch.randn(B, H, prompt, D, generator=g).to(dtype))
    scores = torch.rand(B, H, prompt, generator=g)
    with use_backend("torch"):
        kv = method.compress(0, kv, AttentionStats(column_sums=scores, window_column_sums=scores, raw_keys=kv.keys,
                                                   num_queries=torch.full((B,), prompt)), n_keep, "prefill")
    kv.resize(kv.capacity + 1)
    kv.pack_state()
    kv.write(torch.randn(B, H, 1, D, generator=g).to(dtype), torch.randn(B, H, 1, D, generator=g).to(dtype),
             torch.full((B, 1), prompt))
    if from_rope:
        rope = llama3_rope(D)
        rope.table(dtype)  # the engine makes it when it is built
        given = dict(rope=rope)
    else:
        given = dict(raw_keys=kv.keys)
    stats = AttentionStats(step_attention=torch.rand(B, H, kv.capacity, generator=g), num_queries=torch.ones(B),
                           one_query=True, **given)  # as the engine's decode pass makes them
    counter = Launches(monkeypatch)
    with use_backend("triton"), counter:
        method.observe(0, kv, stats)
        method.evict_one(0, kv, stats, n_keep)
    device_work = counter.kernels + [op for op in counter.torch_ops if op != "aten::empty"]
    assert len(device_work) == launches, device_work


@pytest.mark.parametrize("name", [
    pytest.param(case, marks=() if case in ("streamingllm", "h2o", "cam", "d2o", "weightedkv", "ems_merge_all")
                 else pytest.mark.slow)
    for case in CASES if case.split("_")[0] in ("streamingllm", "h2o", "cam", "d2o", "weightedkv", "ems")])
def test_triton_in_place_keeps_what_compress_keeps(name):
    """tests/test_decode_paths.py's in-place == compress comparison with the fused Triton steps in place."""
    compare_under_random_attention(name, "triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles them in KVBENCH_KERNEL_TESTS=cuda")
def test_kernels_compile_for_the_gpu():
    """The interpreter runs code the Triton compiler refuses: compile every fused step's variants to sm_90
    PTX and cubin (no GPU needed; tests/kernels/ptx_check.py) in a process without TRITON_INTERPRET."""
    assert "kernel variants compiled" in compile_for_sm90("ptx_check.py")
