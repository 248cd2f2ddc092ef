"""In-place one-slot eviction: Triton kernels against the torch references, and a hand-computed row."""

from __future__ import annotations

import pytest
import torch

from kvbench.kernels import slots, triton_slots
from kvbench.kernels.dispatch import use_backend


def storage(B=2, H=3, C=70, D=24, S=2, seed=0, dtype=torch.float32):
    """Rows with ragged lengths, slots in a shuffled order of their positions, stacked states."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(C // 2, C + 1, (B, H), generator=g)
    positions = torch.stack([torch.randperm(C, generator=g) for _ in range(B * H)]).view(B, H, C)
    sinks = torch.randint(0, 5, (B, H), generator=g)
    positions[..., :4] = torch.arange(4)  # sinks sit in the first slots, holding the first tokens
    return dict(
        scores=torch.randint(0, 6, (B, H, C), generator=g).float(),  # small integers: plenty of ties
        lengths=lengths, positions=positions, sinks=sinks,
        recent=torch.randint(0, 8, (B, H), generator=g),
        keys=torch.randn(B, H, C, D, generator=g).to(dtype), values=torch.randn(B, H, C, D + 8, generator=g).to(dtype),
        state=torch.randn(S, B, H, C, generator=g),
    )


def test_select_lowest_hand_computed():
    # one row of 6 slots (positions 0, 1, 8, 6, 9, 7): sink slot 0, the 2 newest positions (9, 8) protected
    scores = torch.tensor([[[0.0, 5.0, 0.1, 2.0, 0.2, 2.0]]])
    positions = torch.tensor([[[0, 1, 8, 6, 9, 7]]])
    args = (scores, torch.tensor([[6]]), positions, torch.tensor([[1]]), torch.tensor([[2]]))
    with use_backend("torch"):
        assert slots.select_lowest(*args).tolist() == [[3]]  # 2.0 at slot 3 (position 6) ties with slot 5 (7)
    assert triton_slots.select_lowest(*args).tolist() == [[3]]


def test_select_lowest_ties_go_to_the_oldest_position():
    # 1.0 at slots 2 (position 9), 3 (position 4) and 5 (position 6): the oldest token, not the lowest slot
    scores = torch.tensor([[[0.0, 5.0, 1.0, 1.0, 3.0, 1.0, 7.0]]])
    positions = torch.tensor([[[0, 1, 9, 4, 5, 6, 10]]])
    args = (scores, torch.tensor([[7]]), positions, torch.tensor([[1]]), torch.tensor([[1]]))
    with use_backend("torch"):
        assert slots.select_lowest(*args).tolist() == [[3]]
    assert triton_slots.select_lowest(*args).tolist() == [[3]]


def test_next_slots_follow_positions_not_slots():
    # positions 0, 8, 3, 5, 9 (slot 5 is padding): after position 3 (slot 2) come 5 (slot 3), 8 (slot 1), 9
    positions = torch.tensor([[[0, 8, 3, 5, 9, 4]]])
    following, real = slots.next_slots(positions, torch.tensor([[5]]), torch.tensor([[2]]), 4)
    assert following[..., :3].tolist() == [[[3, 1, 4]]] and real.tolist() == [[[True, True, True, False]]]
    following, real = slots.next_slots(positions, torch.tensor([[5]]), torch.tensor([[4]]), 9)  # the newest
    assert following.shape[-1] == 6 and not real.any()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_select_lowest_matches_reference(seed):
    s = storage(seed=seed)
    args = (s["scores"], s["lengths"], s["positions"], s["sinks"], s["recent"])
    with use_backend("torch"):
        ref = slots.select_lowest(*args)
    assert torch.equal(triton_slots.select_lowest(*args), ref)


@pytest.mark.parametrize("head_average", [False, True], ids=["per_head", "head_average"])
@pytest.mark.parametrize("capacity", [70, 3000], ids=["one_block", "blocks"])
@pytest.mark.parametrize("states", [0, 3])
def test_evict_lowest_matches_reference(states, capacity, head_average, dtype):
    """The slot each row drops and the move, as the torch path: rows of one block and of several, per-row sinks
    and recent windows, and scores shared by a row's heads (TOVA's head average, a stride-0 view)."""
    ref, got = (storage(C=capacity, S=states, seed=4, dtype=dtype) for _ in range(2))
    if head_average:
        for s in (ref, got):
            s["scores"] = s["scores"][:, :1].expand_as(s["scores"])
    order = ("scores", "lengths", "positions", "sinks", "recent", "keys", "values", "state")
    with use_backend("torch"):
        slots.evict_lowest(*(ref[k] for k in order))
    triton_slots.evict_lowest(*(got[k] for k in order))
    for name in ("lengths", "positions", "keys", "values", "state"):
        assert torch.equal(got[name], ref[name]), name
    assert torch.equal(ref["lengths"], storage(C=capacity, S=states, seed=4)["lengths"] - 1)


@pytest.mark.parametrize("rule", [("h2o", 0.5, 0), ("h2o_sinks", 0.3, 2), ("streamingllm", None, 4),
                                  ("all_sinks", None, 80)], ids=lambda rule: rule[0])
@pytest.mark.parametrize("states", [0, 3])
@pytest.mark.parametrize("capacity", [70, 3000], ids=["one_block", "blocks"])
def test_evict_in_budget_matches_reference(rule, states, capacity):
    """H2O's and StreamingLLM's decode step with the protected counts derived from the budget in the kernels: the
    same slot leaves as the torch path (heavy_split / eviction_order of min(n_keep, length), then select_lowest),
    budgets larger and smaller than the rows, ratios that round differently in float32 (0.3), a budget within
    the sinks (the newest leaves); rows of one block and of several (the newest position and the lowest score,
    ties among them, fall in any block)."""
    _, heavy_ratio, sinks = rule
    ref, got = storage(C=capacity, S=states, seed=5), storage(C=capacity, S=states, seed=5)
    assert triton_slots.row_blocks(6, capacity, triton_slots.BLOCK_SCAN, torch.device("cpu"))[0] == (
        1 if capacity < triton_slots.BLOCK_SCAN else 2)
    n_keep = torch.tensor([50, 80])  # row 0 is over its budget by several slots (a decode step evicts anyway)
    with use_backend("torch"):
        slots.evict_in_budget(ref["scores"], ref["lengths"], ref["positions"], n_keep, sinks, heavy_ratio,
                              ref["keys"], ref["values"], ref["state"])
    triton_slots.evict_in_budget(got["scores"], got["lengths"], got["positions"], n_keep, sinks, heavy_ratio,
                                 got["keys"], got["values"], got["state"])
    for name in ("lengths", "positions", "keys", "values", "state"):
        assert torch.equal(got[name], ref[name]), name


def test_move_last_into_moves_every_part_of_the_slot():
    s = storage(B=1, H=1, C=5, D=2, S=1)
    s["lengths"][:] = 5
    before = {k: s[k].clone() for k in ("keys", "values", "positions", "state")}
    triton_slots.move_last_into(torch.tensor([[1]]), s["lengths"], s["keys"], s["values"], s["positions"], s["state"])
    assert s["lengths"].tolist() == [[4]]
    for name, old in before.items():
        assert torch.equal(s[name][..., 1, :] if name in ("keys", "values") else s[name][..., 1],
                           old[..., 4, :] if name in ("keys", "values") else old[..., 4]), name
