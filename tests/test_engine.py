"""The engine and the compressed cache: exactness against plain transformers, batching, ragged storage."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.errors import ConfigError
from kvbench.kernels.select import keep_topk
from kvbench.kv import LayerKV
from kvbench.methods.base import Method, per_sample_n_keep
from kvbench.methods.full import Full


@dataclass
class KeepEveryOther(Method):
    """Test method: head h keeps every other slot starting at h, so heads end up with different lengths."""

    name: ClassVar[str] = "every_other"
    phases: ClassVar[frozenset[str]] = frozenset({"prefill"})

    def compress(self, layer, kv, stats, n_keep, phase, host=None):
        B, H, T = kv.positions.shape
        slots = torch.arange(T)
        rows, lens = [], torch.zeros(B, H, dtype=torch.long)
        for b in range(B):
            for h in range(H):
                kept = slots[(slots % (h + 2) == 0) & (slots < kv.lengths[b, h])]
                rows.append(kept)
                lens[b, h] = len(kept)
        K = int(lens.max())
        index = torch.stack([torch.cat([r, r[-1:].expand(K - len(r))]) for r in rows]).view(B, H, K)
        return kv.gather(index, lens)


@dataclass
class LastN(Method):
    """Test method: keeps the newest n_keep slots of every row, at prefill and while decoding."""

    name: ClassVar[str] = "last_n"
    phases: ClassVar[frozenset[str]] = frozenset({"prefill", "decode"})
    compress_during_decode: bool = True

    def compress(self, layer, kv, stats, n_keep, phase, host=None):
        scores = kv.positions.float()
        index, lengths = keep_topk(scores, per_sample_n_keep(n_keep, kv), kv.lengths)
        return kv.gather(index, lengths)


def greedy_reference(model, prompt: list[int], steps: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0,
                         min_new_tokens=steps)
    return out[0, len(prompt):].tolist()


def prompts(n_tokens: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in n_tokens]


def test_full_cache_equals_plain_generate(tiny_model):
    engine = Engine(tiny_model, Full(), Budget("fraction", 1.0))
    for prompt in prompts([37, 80], tiny_model.config.vocab_size):
        got = engine.generate([prompt], max_new_tokens=25, stop_token_ids=set())[0].tokens
        assert got == greedy_reference(tiny_model, prompt, 25)


@pytest.mark.parametrize("method", [Full(), LastN(), KeepEveryOther()], ids=lambda m: m.name)
def test_batch_of_two_with_left_padding_equals_batch_of_one(tiny_model, method):
    engine = Engine(tiny_model, method, Budget("fraction", 0.5))
    batch = prompts([61, 23], tiny_model.config.vocab_size, seed=1)
    together = engine.generate(batch, max_new_tokens=12, stop_token_ids=set())
    alone = [engine.generate([p], max_new_tokens=12, stop_token_ids=set())[0] for p in batch]
    for a, b in zip(together, alone):
        assert a.tokens == b.tokens
        assert a.kept_per_layer_head == b.kept_per_layer_head


def test_repeated_rows_are_prefilled_once_and_decode_as_rows_alone(tiny_model, monkeypatch):
    engine = Engine(tiny_model, KeepEveryOther(), Budget("fraction", 0.5))
    first, second = prompts([40, 33], tiny_model.config.vocab_size, seed=2)
    calls = []
    prefill_row = engine._prefill_row
    monkeypatch.setattr(engine, "_prefill_row", lambda *a: calls.append(len(a[0])) or prefill_row(*a))
    together = engine.generate([first, second, first], max_new_tokens=10, stop_token_ids=set())
    assert calls == [40, 33]  # the third row is the first one's copy
    alone = engine.generate([first], max_new_tokens=10, stop_token_ids=set())[0]
    assert together[0].tokens == together[2].tokens == alone.tokens
    assert together[2].kept_per_layer_head == alone.kept_per_layer_head


def test_compressed_cache_really_shrinks_and_keeps_kv_heads(tiny_model):
    engine = Engine(tiny_model, LastN(), Budget("fraction", 0.25))
    prompt = prompts([64], tiny_model.config.vocab_size)[0]
    session = engine.prefill([prompt], max_new_tokens=4)
    for layer in session.cache.layers:
        # static capacity: the budget plus the one slot a decode step adds before it evicts
        assert layer.kv.keys.shape == (1, tiny_model.config.num_key_value_heads, 17, layer.kv.keys.shape[-1])
        assert layer.kv.lengths.tolist() == [[16, 16]]
        assert layer.kv.positions[0, 0, :16].tolist() == list(range(48, 64))
    gen = engine.generate([prompt], max_new_tokens=6, stop_token_ids=set())[0]
    assert gen.kv_bytes_compressed * 4 == gen.kv_bytes_full
    assert gen.kv_bytes_final == gen.kv_bytes_compressed  # decode-time compression keeps it at n_keep


def test_ragged_heads_attention_matches_dense_reference(tiny_model):
    """After per-head ragged compression, decoding must equal attention over exactly the kept tokens.

    Reference: for one layer, run the same decode step by hand with a dense mask built from kept positions.
    """
    engine = Engine(tiny_model, KeepEveryOther(), Budget("fraction", 1.0))
    prompt = prompts([30], tiny_model.config.vocab_size, seed=3)[0]
    session = engine.prefill([prompt], max_new_tokens=2)
    kv = session.cache.kv(0)
    assert kv.lengths.tolist() == [[15, 10]]  # head 0 keeps slots 0,2,..,28; head 1 keeps 0,3,..,27
    from kvbench.kernels.attention_stats import ragged_attention

    g = torch.Generator().manual_seed(5)
    B, H, T, D = kv.keys.shape
    q = torch.randn(1, 4, 1, D, generator=g)
    out, _ = ragged_attention(q, kv.keys, kv.values, kv.valid(), kv.positions, torch.tensor([[30]]), 0.125)
    for head in range(4):
        kvh = head // 2
        n = int(kv.lengths[0, kvh])
        k, v = kv.keys[0, kvh, :n], kv.values[0, kvh, :n]
        ref = torch.softmax(q[0, head, 0] @ k.T * 0.125, -1) @ v
        torch.testing.assert_close(out[0, head, 0], ref)


def test_decode_compression_holds_the_budget(tiny_model):
    engine = Engine(tiny_model, LastN(), Budget("tokens", 8))
    session = engine.prefill(prompts([20], tiny_model.config.vocab_size), max_new_tokens=5)
    for step in range(5):
        session.feed(torch.tensor([[7 + step]]))
        assert session.cache.lengths().max() == 8
    assert session.cache.kv(1).positions[0, 0, :8].tolist() == list(range(17, 25))  # + one spare decode slot


def test_a_pass_tells_its_observers_whether_each_row_has_one_query(tiny_model):
    """``AttentionStats.one_query`` (what WeightedKV's observation counts its observers by) is the host's q == 1."""
    engine = Engine(tiny_model, LastN(), Budget("tokens", 8))
    session = engine.prefill(prompts([20], tiny_model.config.vocab_size), max_new_tokens=5)
    session.feed(torch.tensor([[5, 6, 7]]), phase="extend")
    assert [s.one_query for s in session.cache.pass_stats] == [False] * tiny_model.config.num_hidden_layers
    session.feed(torch.tensor([[7]]))
    assert [s.one_query for s in session.cache.pass_stats] == [True] * tiny_model.config.num_hidden_layers
    assert session.cache.pass_stats[0].num_queries.tolist() == [1]


def test_extend_phase_does_not_compress(tiny_model):
    engine = Engine(tiny_model, LastN(), Budget("tokens", 8))
    session = engine.prefill(prompts([20], tiny_model.config.vocab_size), max_new_tokens=5)
    session.feed(torch.tensor([[5, 6, 7]]), phase="extend")
    assert session.cache.lengths().max() == 11


def test_suffix_after_compression_matches_concatenated_prompt_under_full(tiny_model):
    engine = Engine(tiny_model, Full(), Budget("fraction", 1.0))
    context, question = prompts([40, 9], tiny_model.config.vocab_size, seed=4)
    split = engine.generate([context], 10, set(), suffixes=[question])[0].tokens
    whole = engine.generate([context + question], 10, set())[0].tokens
    assert split == whole


def test_layer_kv_gather_moves_state_and_zeroes_padding():
    keys = torch.arange(2 * 5 * 1, dtype=torch.float32).view(1, 2, 5, 1)
    kv = LayerKV.from_dense(keys, keys + 100)
    kv.state["score"] = keys[..., 0] * 10
    index = torch.tensor([[[0, 3, 4], [1, 2, 2]]])
    out = kv.gather(index, torch.tensor([[3, 2]]))
    assert out.keys[0, :, :, 0].tolist() == [[0, 3, 4], [6, 7, 0]]
    assert out.values[0, 0, :, 0].tolist() == [100, 103, 104]
    assert out.positions.tolist() == [[[0, 3, 4], [1, 2, -1]]]
    assert out.state["score"].tolist() == [[[0, 30, 40], [60, 70, 0]]]


@pytest.mark.parametrize("capacity", [8, 11])  # the row's own capacity (its storage adopted), larger (copied)
@pytest.mark.parametrize("inference", [False, True])  # a row made in inference mode is copied
def test_a_batch_of_its_one_row_holds_what_allocating_and_placing_it_writes(capacity, inference):
    """``CompressedLayer.allocate_alone`` (a decode batch's only row) against ``allocate`` then ``place``: the same
    keys, values, positions, state, tables, lengths and mirror, stale slots past the row's longest head cleared,
    and storage that steps may update in place outside inference mode."""
    from kvbench.cache import CompressedLayer

    def row_layer() -> CompressedLayer:
        g = torch.Generator().manual_seed(0)
        with torch.inference_mode(inference):
            kv = LayerKV.from_dense(torch.randn(1, 2, 8, 3, generator=g), torch.randn(1, 2, 8, 3, generator=g))
            kv.state = {"a": torch.rand(1, 2, 8, generator=g), "b": torch.rand(1, 2, 8, generator=g)}
            kv.tables = {"t": torch.arange(6).view(1, 2, 3).clone()}
            kv.lengths = torch.tensor([[6, 4]])
            kv.pack_state()
        layer = CompressedLayer()
        layer.lazy_initialization(kv.keys, kv.values)
        layer.adopt(kv, kv.lengths.numpy())
        return layer  # slots 6 and 7 of both heads hold stale data, as slots 4 and 5 of head 1 (its own padding)

    alone, general, row = CompressedLayer(), CompressedLayer(), row_layer()
    own_keys = row.kv.keys
    alone.allocate_alone(row, capacity)
    general.allocate(row_layer(), 1, capacity)
    with torch.inference_mode():
        general.place(torch.tensor([0]).numpy(), row_layer(), capacity)
    a, b = alone.kv, general.kv
    for name in ("keys", "values", "positions", "lengths"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.state.keys() == b.state.keys() and all(torch.equal(a.state[n], b.state[n]) for n in a.state)
    assert torch.equal(a.tables["t"], b.tables["t"]) and a.packed_state() is not None
    assert (alone.host_lengths == general.host_lengths).all() and alone.longest == general.longest == 6
    assert not any(t.is_inference() for t in (a.keys, a.values, a.positions, a.state_block))
    assert (a.keys is own_keys) == (capacity == 8 and not inference)  # adopted only where it can serve as it is
    a.keys.add_(1)  # outside inference mode


def test_layer_kv_append_writes_after_each_rows_end():
    kv = LayerKV.from_dense(torch.ones(1, 2, 3, 1), torch.ones(1, 2, 3, 1))
    kv.lengths = torch.tensor([[3, 1]])
    kv.zero_padding()
    kv.append(torch.full((1, 2, 1, 1), 9.0), torch.full((1, 2, 1, 1), 8.0), torch.tensor([[7]]))
    assert kv.lengths.tolist() == [[4, 2]]
    assert kv.keys[0, 0, :4, 0].tolist() == [1, 1, 1, 9]
    assert kv.keys[0, 1, :2, 0].tolist() == [1, 9]
    assert kv.positions[0, 1, :2].tolist() == [0, 7]


def test_keep_topk_protects_sinks_and_recent_window():
    scores = torch.tensor([[[0.0, 9.0, 1.0, 8.0, 0.5, 0.1, 0.2, 7.0]]])
    index, lengths = keep_topk(scores, torch.tensor([[5]]), torch.tensor([[8]]), sinks=1, recent=2)
    # sink 0, recent 6 and 7, then the two best others: 1 (9.0) and 3 (8.0)
    assert index.tolist() == [[[0, 1, 3, 6, 7]]]
    assert lengths.tolist() == [[5]]


def test_keep_topk_gives_each_row_of_a_batch_what_it_keeps_alone_among_tied_scores():
    """Rows of one batch at different budgets (the points of one method compressing together): a row with the
    smaller budget breaks ties among equal scores as it does alone, not as the larger budget's topk would."""
    g = torch.Generator().manual_seed(3)
    pooled = torch.randint(0, 3, (1, 2, 40), generator=g).float()  # many ties, as max-pooled scores have
    for scores in (pooled, torch.zeros(1, 2, 40)):
        batch = scores.expand(3, -1, -1)
        n_keep = torch.tensor([[5, 5], [17, 17], [9, 9]])
        index, lengths = keep_topk(batch, n_keep, torch.full((3, 2), 40), recent=2)
        for b in range(3):
            alone, alone_lengths = keep_topk(scores, n_keep[b:b + 1], torch.full((1, 2), 40), recent=2)
            assert torch.equal(lengths[b:b + 1], alone_lengths)
            assert torch.equal(index[b:b + 1, :, :alone.shape[-1]], alone)


@pytest.mark.parametrize("kind,value", [("fraction", 0.0), ("fraction", 1.5), ("tokens", 0), ("tokens", 2.5),
                                        ("ratio", 0.2)])
def test_bad_budgets_are_rejected_with_the_value(kind, value):
    with pytest.raises(ConfigError, match=str(value) if kind != "ratio" else "ratio"):
        Budget(kind, value)


def test_budget_rounding_and_bases():
    b = Budget("fraction", 0.2)
    assert b.n_keep(torch.tensor([10, 11, 13, 2]), 0, "prompt").tolist() == [2, 2, 3, 1]
    assert b.n_keep(torch.tensor([10]), 5, "prompt_plus_generation").tolist() == [3]
    assert Budget("tokens", 256).n_keep(torch.tensor([10, 1000]), 0, "prompt").tolist() == [256, 256]


def test_unknown_position_mode_is_rejected(tiny_model):
    with pytest.raises(ConfigError, match="sideways.*original, cache_length"):
        Engine(tiny_model, Full(), Budget("fraction", 1.0), position_mode="sideways")


@dataclass
class DuplicateFirstHalf(Method):
    """Test method: merges each pair of identical slots (2i, 2i+1) into one slot with logit bias log 2."""

    name: ClassVar[str] = "pairs"
    with_bias: bool = True

    def compress(self, layer, kv, stats, n_keep, phase, host=None):
        T = kv.max_length
        index = torch.arange(0, T, 2).expand(*kv.lengths.shape, -1)
        out = kv.gather(index, torch.full_like(kv.lengths, index.shape[-1]))
        if self.with_bias:
            out.state["logit_bias"] = torch.full(out.positions.shape, math.log(2.0))
        return out


def test_logit_bias_makes_a_merged_slot_weigh_like_its_members():
    """Attention over pairs of identical keys equals attention over one key per pair plus log 2 on its logit."""
    from kvbench.kernels.attention_stats import ragged_attention

    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 1, 3, 4, generator=g).repeat_interleave(2, dim=2)  # k0 k0 k1 k1 k2 k2
    keys[0, 0, 5] += 1.0  # the last pair differs: the bias must not make it an exact duplicate
    values = torch.randn(1, 1, 6, 4, generator=g)
    values[0, 0, 1::2] = values[0, 0, 0::2]
    q = torch.randn(1, 2, 1, 4, generator=g)
    kv = LayerKV.from_dense(keys, values)
    dense, _ = ragged_attention(q, keys[:, :, :5], values[:, :, :5], kv.valid()[:, :, :5], kv.positions[:, :, :5],
                                torch.tensor([[9]]), 0.5)
    merged = DuplicateFirstHalf().compress(0, LayerKV.from_dense(keys[:, :, :5], values[:, :, :5]), None, None, "")
    merged.state["logit_bias"][0, 0, 2] = 0.0  # slot 4 stands for one token (the pair was cut at 5)
    out, _ = ragged_attention(q, merged.keys, merged.values, merged.valid(), merged.positions, torch.tensor([[9]]),
                              0.5, key_bias=merged.state["logit_bias"])
    torch.testing.assert_close(out, dense)


def test_engine_applies_a_methods_logit_bias(tiny_model):
    prompt = prompts([24], tiny_model.config.vocab_size, seed=8)[0]
    logits = []
    for method in (DuplicateFirstHalf(), DuplicateFirstHalf(with_bias=False)):
        session = Engine(tiny_model, method, Budget("fraction", 0.5)).prefill([prompt], 2)
        session.feed(torch.tensor([[5]]))
        logits.append(session.logits)
    assert not torch.allclose(logits[0], logits[1])  # the bias reaches attention
