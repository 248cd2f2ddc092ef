"""Continuous batching (``kvbench.decode``): every row decodes exactly as it does alone at batch 1, whatever joins
or leaves the batch around it, for every shipped method, one point or several in one forward pass."""

from __future__ import annotations

import time

import pytest

import torch

from kvbench.budget import Budget
from kvbench.decode import DecodeBatch, DecodeRequest, auto_batch_size
from kvbench.engine import Engine
from kvbench.kernels.dispatch import use_backend
from tests.test_decode_paths import CASES, HostReads, build, random_prompts

LENGTHS = [40, 9, 25, 33]  # very different lengths; 9 is under the budget: that row grows to it while decoding


def alone(engine: Engine, prompt: list[int], request: DecodeRequest):
    return engine.generate([prompt], request.max_new_tokens, set(request.stop_token_ids),
                           min_new_tokens=request.min_new_tokens, stop_when=request.stop_when)[0]


def requests_for(engine: Engine, prompts: list[list[int]]) -> list[tuple[DecodeRequest, list[int]]]:
    """One request per row, each ending another way, and the tokens the row gives alone with it (greedy decoding
    alone is prefix-stable, so they are the row's 8 tokens alone cut where the request stops): max_new_tokens
    (8, then 3), EOS (a token the row emits alone), a stop string (the same, seen by ``stop_when``)."""
    plain = [alone(engine, p, DecodeRequest(8)).tokens for p in prompts]
    eos, last = plain[2][2], plain[3][3]
    return [(DecodeRequest(8), plain[0]), (DecodeRequest(3), plain[1][:3]),
            (DecodeRequest(8, frozenset({eos})), plain[2][:plain[2].index(eos)]),
            (DecodeRequest(8, stop_when=lambda tokens: tokens[-1] == last), plain[3][:plain[3].index(last) + 1])]


def run(batch: DecodeBatch, rows: list[tuple[int, object, DecodeRequest]]) -> dict:
    """Admit every (point, row, request) as slots free up, step until done; the generations by admission order."""
    waiting, done = list(enumerate(rows)), {}
    while waiting or batch.busy:
        for tag, (point, row, request) in list(waiting):
            if batch.vacancies(point) > 0:
                batch.admit(point, row, request, tag=tag)
                waiting.remove((tag, (point, row, request)))
        for finished in batch.step():
            done[finished.tag] = finished.generation
    batch.close()
    return done


def test_every_method_decodes_its_rows_as_alone_in_one_batch_of_all_points(tiny_model):
    """All methods as points of one batch, two slots each, more rows than slots, rows of very different lengths
    ending in every way: each row's tokens are its own alone."""
    prompts = random_prompts(LENGTHS, tiny_model.config.vocab_size)
    with use_backend("torch"):
        engines = [Engine(tiny_model, build(name), Budget("tokens", 12)) for name in CASES]
        rows, expected = [], []
        for point, engine in enumerate(engines):
            for prompt, (request, tokens) in zip(prompts, requests_for(engine, prompts)):
                rows.append((point, engine.prefill_row(prompt, request.max_new_tokens), request))
                expected.append(tokens)
        got = run(DecodeBatch(engines, slots=2, lag=1), rows)
    for tag, tokens in enumerate(expected):
        assert got[tag].tokens == tokens, f"{list(CASES)[rows[tag][0]]} row {tag % len(prompts)}"
    assert {g.stopped_by for g in got.values()} == {"max_new_tokens", "eos", "stop_string"}


@pytest.mark.parametrize("name", ["full", "h2o", "snapkv", "chelsea", "ems", "d2o"])
@pytest.mark.parametrize("lag", [0, 1])
def test_one_point_with_fewer_slots_than_rows_equals_rows_alone(tiny_model, name, lag):
    """Tokens, stop reasons and realized cache sizes as alone; one row's EOS is masked before min_new_tokens."""
    engine = Engine(tiny_model, build(name), Budget("tokens", 12))
    prompts = random_prompts(LENGTHS + [17], tiny_model.config.vocab_size, seed=3)
    with use_backend("torch"):
        first = alone(engine, prompts[4], DecodeRequest(9)).tokens
        requests = [request for request, _ in requests_for(engine, prompts[:4])]
        requests.append(DecodeRequest(9, frozenset(first[:2]), min_new_tokens=3))
        got = run(DecodeBatch([engine], slots=2, lag=lag),
                  [(0, engine.prefill_row(p, r.max_new_tokens), r) for p, r in zip(prompts, requests)])
        want = [alone(engine, p, r) for p, r in zip(prompts, requests)]
    for tag, row in enumerate(want):
        assert got[tag].tokens == row.tokens
        assert got[tag].stopped_by == row.stopped_by
        assert got[tag].kv_bytes_final == row.kv_bytes_final
        assert got[tag].decode_kv_bytes_mean == pytest.approx(row.decode_kv_bytes_mean, nan_ok=True)
    assert all(g.tpot_seconds > 0 and g.decode_seconds > 0 and g.batch_size == 2 for g in got.values())


def test_a_rows_first_step_is_timed_from_its_first_token(tiny_model, monkeypatch):
    """The time between a row's first token (its prefill's end) and its second includes placing the row into the
    batch's storage, as ``model.generate``'s own gap does: a placement slowed by 0.3 s shows in the first step,
    not in the steps after it."""
    from kvbench.engine import Session

    allocate = Session.allocate.__func__

    def slow_allocate(cls, *args, **kwargs):
        time.sleep(0.3)
        return allocate(cls, *args, **kwargs)

    engine = Engine(tiny_model, build("h2o"), Budget("tokens", 12))
    prompt = random_prompts([30], tiny_model.config.vocab_size, seed=5)[0]
    monkeypatch.setattr(Session, "allocate", classmethod(slow_allocate))
    with use_backend("torch"):
        got = engine.generate([prompt], 6, set(), min_new_tokens=6)[0]
    assert got.first_step_seconds >= 0.3
    assert got.tpot_after_first_seconds < 0.3
    steps = len(got.tokens) - 1  # the first token is the prefill's
    after = (steps - 1) * got.tpot_after_first_seconds
    assert got.tpot_seconds * steps == pytest.approx(got.first_step_seconds + after)


def test_generate_decodes_more_prompts_than_its_batch_size(tiny_model):
    engine = Engine(tiny_model, build("tova"), Budget("fraction", 0.3), batch_size=2)
    prompts = random_prompts(LENGTHS + [17], tiny_model.config.vocab_size, seed=4)
    together = engine.generate(prompts, 7, stop_token_ids=set())
    for prompt, got in zip(prompts, together):
        assert got.tokens == engine.generate([prompt], 7, stop_token_ids=set())[0].tokens
        assert got.prompt_length == len(prompt) and got.batch_size == 2


@pytest.mark.parametrize("name", ["h2o", "snapkv", "d2o"])
def test_rows_with_suffixes_join_a_batch_of_steady_rows_as_alone(tiny_model, name):
    """A row fed a suffix after its compression joins over budget by more than one slot: its first step
    compresses it alone (``Method.compress`` on that row) while the others evict in place."""
    engine = Engine(tiny_model, build(name), Budget("tokens", 12), batch_size=2)
    contexts = random_prompts([50, 31, 44], tiny_model.config.vocab_size, seed=11)
    suffixes = random_prompts([5, 3, 7], tiny_model.config.vocab_size, seed=12)
    with use_backend("torch"):
        together = engine.generate(contexts, 8, set(), suffixes=suffixes)
        rows = [engine.generate([c], 8, set(), suffixes=[s])[0] for c, s in zip(contexts, suffixes)]
    assert [g.tokens for g in together] == [g.tokens for g in rows]


@pytest.mark.parametrize("name", CASES)
def test_steady_batch_step_never_waits_for_the_device(tiny_model, name):
    """Once its rows are steady, a step (launch and the reading of its tokens) reads nothing back from the
    device (the GPU run checks the same with torch.cuda.set_sync_debug_mode)."""
    method = build(name)
    engine = Engine(tiny_model, method, Budget("tokens", 12))
    prompts = random_prompts([45, 30], tiny_model.config.vocab_size)
    with use_backend("torch"):
        batch = DecodeBatch([engine], slots=2, lag=1)
        for tag, prompt in enumerate(prompts):
            batch.admit(0, engine.prefill_row(prompt, 12), DecodeRequest(12), tag)
        batch.step()  # places the rows and leaves the prefill state: every row decodes at its budget
        session = batch.points[0].session
        for _ in range(3):
            due = method.compress_during_decode and session.due_rows(ahead=1).any()
            with HostReads() as reads:
                batch.step()
            if not due or engine.in_place_eviction(1):
                assert reads.seen == [], f"{name}: a decode step read the device: {reads.seen}"
        batch.close()


def test_only_a_row_its_first_token_can_end_waits_for_its_prompt_pass_at_placement(tiny_model):
    """A row that its first token cannot end (two tokens or more, no stop string, no stop token pickable first) is
    placed without the host reading its first token (the device may still run its prompt pass: the host places
    the row and records the step's graph meanwhile); the token is read with the row's first step, first in its
    output. A row that its first token can end is read at its placement."""
    engine = Engine(tiny_model, build("h2o"), Budget("tokens", 12))
    prompt = random_prompts([30], tiny_model.config.vocab_size)[0]
    with use_backend("torch"):
        first, runner_up = engine.prefill([prompt], 8).logits.topk(2, -1).indices[0].tolist()
        cases = [(DecodeRequest(8), False, first),
                 (DecodeRequest(8, frozenset({first}), min_new_tokens=1), False, runner_up),  # the stop masked
                 (DecodeRequest(8, frozenset({runner_up})), True, first), (DecodeRequest(1), True, first),
                 (DecodeRequest(8, stop_when=lambda tokens: False), True, first)]
        for request, read, expected in cases:
            batch = DecodeBatch([engine], slots=1, lag=1)
            batch.admit(0, engine.prefill_row(prompt, 8, wait=False), request)
            with HostReads() as reads:
                batch.place()
            assert bool(reads.seen) == read, (request, reads.seen)
            generation = run(batch, [])[None]  # the admitted row (tag None), decoded to its end
            assert generation.tokens[0] == expected, request


def test_a_repeated_row_fills_every_slot_from_one_prefill(tiny_model, monkeypatch):
    engine = Engine(tiny_model, build("h2o"), Budget("tokens", 12))
    prompt = random_prompts([30], tiny_model.config.vocab_size)[0]
    calls = []
    prefill_row = engine._prefill_row
    monkeypatch.setattr(engine, "_prefill_row", lambda *a: calls.append(1) or prefill_row(*a))
    gens = engine.generate([prompt] * 3, 6, stop_token_ids=set(), batch_size=2)
    assert calls == [1]
    assert len({tuple(g.tokens) for g in gens}) == 1
    assert gens[0].prefill_seconds == pytest.approx(gens[2].prefill_seconds)


def test_auto_batch_size_on_a_cpu_is_capped(tiny_model):
    engine = Engine(tiny_model, build("snapkv"), Budget("tokens", 12), batch_size="auto")
    prompts = random_prompts([20] * 10, tiny_model.config.vocab_size, seed=5)
    row = engine.prefill_row(prompts[0], 4)
    assert auto_batch_size(engine, row, DecodeRequest(4), rows=10) == 8
    assert auto_batch_size(engine, row, DecodeRequest(4), rows=3) == 3
    assert {g.batch_size for g in engine.generate(prompts, 3, stop_token_ids=set())} == {8}


def test_rows_of_a_point_must_come_from_its_engine(tiny_model):
    first, second = (Engine(tiny_model, build(n), Budget("tokens", 12)) for n in ("full", "h2o"))
    batch = DecodeBatch([first, second], slots=1)
    row = second.prefill_row(random_prompts([20], tiny_model.config.vocab_size)[0], 4)
    with pytest.raises(ValueError, match="point 0"):
        batch.admit(0, row, DecodeRequest(4))


def test_bad_batch_sizes_are_rejected_with_the_value(tiny_model):
    from kvbench.errors import ConfigError

    for bad in (0, "big", 2.5):
        with pytest.raises(ConfigError, match=f"batch_size={bad!r}; accepted: an integer >= 1 or auto"):
            Engine(tiny_model, build("full"), Budget("fraction", 1.0), batch_size=bad)


def test_cuda_graphs_auto_is_off_on_a_cpu(tiny_model):
    assert Engine(tiny_model, build("full"), Budget("fraction", 1.0)).cuda_graphs is False


class ReplayedOnTheHost:
    """A stand-in for ``torch.cuda.CUDAGraph`` on a CPU: capturing runs the step (host and device work, as a
    capture's host side plus the replay that follows it); a later replay runs the same step's device work
    again and puts the host side back as it was, as a real replay leaves it (``DecodeGraph.flush`` applies it)."""

    runner = None  # the DecodeGraph whose step a capture records (set by the test)

    def __init__(self) -> None:
        self.fresh = True
        self.step: tuple = ()  # the runner's sessions and step, set when the capture ends

    def capture_begin(self) -> None:
        pass

    def capture_end(self) -> None:
        import gc

        assert not gc.isenabled(), "the garbage collector waits while a step is recorded"
        self.step = (self.runner.sessions, self.runner.body)

    def replay(self) -> None:
        if self.fresh:  # the replay right after the capture: the capture already did the work
            self.fresh = False
            return
        sessions, body = self.step
        pending = self.runner.pending  # replays before this one whose host side is not applied yet
        captured = [value for action, value in self.runner.captured if action == "position_limit"]
        assert captured == [s.position_limit(1 + pending) for s in sessions if s.engine.expand is not None], \
            "a step replays under the position limit it was captured with"
        saved = [([(l.host_lengths.copy(), l.longest, l.aligned, l.ordered) for l in s.cache.layers],
                  s.decode_steps, s.row_steps.copy(), s.host_next_index.copy(), s.logits) for s in sessions]
        body(True)
        for s, (layers, steps, row_steps, next_index, logits) in zip(sessions, saved):
            for layer, (lengths, longest, aligned, ordered) in zip(s.cache.layers, layers):
                layer.host_lengths, layer.longest, layer.aligned, layer.ordered = lengths, longest, aligned, ordered
            s.decode_steps, s.row_steps, s.host_next_index, s.logits = steps, row_steps, next_index, logits


@pytest.mark.parametrize("name", ["full", "h2o", "snapkv", "chelsea_interval4", "ems_merge_all"])
def test_replayed_steps_and_their_lazy_host_side_decode_as_alone(tiny_model, name, monkeypatch, caplog):
    """The graph runner's bookkeeping on a CPU (captures replayed on the host): decisions, steps known safe, the
    host side applied lazily, bytes read per step; every row as alone, and steps replayed; the batch's log
    line counts its steps by kind. EMS's steps depend on the rows' position limit, which here changes every 16
    positions (a capture again each time); the rows' next positions stay mirrored on the host."""
    import logging

    from kvbench import engine as engine_module, graphs
    from tests.golden.record import CASES as GOLDEN_CASES, build_method

    monkeypatch.setattr(torch.cuda, "CUDAGraph", ReplayedOnTheHost)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(graphs, "capture_stream", lambda: None)  # torch.cuda.stream(None) changes nothing
    monkeypatch.setattr(graphs, "WARMED", set())
    monkeypatch.setattr(engine_module, "POSITION_LIMIT_STEP", 16)
    method = build_method(*GOLDEN_CASES[name]) if name in GOLDEN_CASES else build(name)
    engine = Engine(tiny_model, method, Budget("tokens", 12))
    prompts = random_prompts(LENGTHS + [17, 50], tiny_model.config.vocab_size, seed=9)
    with use_backend("torch"):
        batch = DecodeBatch([engine], slots=3, lag=1)
        batch.graphs = True
        build_runner = batch._build_runner

        def keep_runner():
            build_runner()
            monkeypatch.setattr(ReplayedOnTheHost, "runner", batch.runner)

        batch._build_runner = keep_runner
        requests = [DecodeRequest(n) for n in (14, 5, 9, 14, 7, 11)]
        with caplog.at_level(logging.INFO, logger="kvbench"):
            got = run(batch, [(0, engine.prefill_row(p, r.max_new_tokens), r) for p, r in zip(prompts, requests)])
        session = batch.points[0].session
        assert session.host_next_index.tolist() == session.next_index.tolist()
        want = [alone(engine, p, r) for p, r in zip(prompts, requests)]
    for tag, row in enumerate(want):
        assert got[tag].tokens == row.tokens, f"row {tag}"
        assert got[tag].kv_bytes_final == row.kv_bytes_final
        assert got[tag].decode_kv_bytes_mean == pytest.approx(row.decode_kv_bytes_mean)
    # rows that joined at different times compress at different steps (intervals count per row): those run eagerly
    assert batch.replays > (0 if method.decode_interval > 1 else batch.launched / 3)
    kinds = batch.steps_by_kind
    assert sum(kinds.values()) == batch.launched and kinds["warm-up"] >= 1 and kinds["capture"] >= 1
    if method.expands_slots:  # captured again as the rows' position limit moves
        assert kinds["capture"] >= 2
    assert set(batch.seconds_by_kind) == set(kinds) and min(batch.seconds_by_kind.values()) > 0
    counted = ", ".join(f"{kinds[k]} {k} {batch.seconds_by_kind[k]:.3f} s" for k in ("replay", "capture", "warm-up",
                                                                                      "eager") if kinds[k])
    import gc

    assert gc.isenabled(), "and runs again after"
    phases = batch.capture_host
    assert set(phases) == {"recording", "instantiating"} and phases["recording"] > 0
    assert (f"decode batch of 1 points x 3 slots: {batch.launched} steps ({counted}; captures on the host: "
            f"recording {phases['recording']:.3f} s, instantiating {phases['instantiating']:.3f} s)") in caplog.text
    record = next(r for r in caplog.records if r.getMessage().startswith("decode batch"))
    assert record.capture_host_seconds == dict(phases) and record.steps_by_kind == dict(kinds)


@pytest.mark.parametrize("name", ["full", "h2o", "d2o"])  # per-layer prefill, in-place decode, deferred budgets
def test_a_generation_leaves_no_cache_behind_for_the_garbage_collector(tiny_model, name):
    """Everything a generation allocated is freed when its last reference goes, not at the next garbage collection
    (a cache kept alive by a reference cycle holds its memory into the next run: the 64k efficiency runs ran out
    of memory so)."""
    import gc

    engine = Engine(tiny_model, build(name), Budget("fraction", 0.5), attn_implementation="sdpa")
    prompts = random_prompts([40, 33], tiny_model.config.vocab_size)
    gc.collect()
    gc.disable()
    try:
        engine.generate(prompts, 6, stop_token_ids=set(), batch_size=2)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        cyclic = [o for o in gc.garbage if torch.is_tensor(o)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cyclic == []


@pytest.mark.parametrize("headroom", [0.25, 0.0])
def test_a_data_driven_point_keeps_its_first_storage_for_shorter_prompts(tiny_model, headroom, monkeypatch):
    """D2O's layer budgets come from each prompt's attention, so a shorter prompt after the first may need more
    slots in some layer; the batch's storage has room for that (``Engine.batch_capacities``), so it is never
    re-allocated (which would re-capture the step's graph). Without the room (0.0) the same rows outgrow it."""
    from kvbench import engine as engine_module

    monkeypatch.setattr(engine_module, "DATA_DRIVEN_HEADROOM", headroom)
    engine = Engine(tiny_model, build("d2o"), Budget("fraction", 0.2))
    prompts = random_prompts([600 - 2 * i for i in range(8)], tiny_model.config.vocab_size, seed=0)
    request = DecodeRequest(6)
    rows = [(0, engine.prefill_row(p, request.max_new_tokens), request) for p in prompts]
    needs = [engine.planned_capacities(row, request.max_new_tokens) for _, row, _ in rows]
    storage = engine.batch_capacities(rows[0][1], request.max_new_tokens)
    room = int(headroom * sum(needs[0]) / len(needs[0]))
    assert storage == [need + room for need in needs[0]]  # under the limit: 600 prompt tokens + 6
    with use_backend("torch"):
        batch = DecodeBatch([engine], slots=2, lag=0)
        run(batch, rows)
    capacities = [layer.kv.capacity for layer in batch.points[0].session.cache.layers]
    outgrown = any(need > s for row_needs in needs for need, s in zip(row_needs, needs[0]))
    assert outgrown, "the prompts no longer exercise a later row needing more than the first"
    if headroom:
        assert all(max(n[layer] for n in needs) <= storage[layer] for layer in range(len(storage)))
        assert capacities == storage
    else:
        assert capacities != storage


def test_batch_capacities_of_a_method_within_its_budget_are_what_the_row_needs(tiny_model):
    engine = Engine(tiny_model, build("snapkv"), Budget("fraction", 0.2))
    row = engine.prefill_row(random_prompts([300], tiny_model.config.vocab_size)[0], 6)
    assert engine.batch_capacities(row, 6) == engine.planned_capacities(row, 6)


def test_a_first_placement_releases_the_row_layer_by_layer(tiny_model, monkeypatch):
    """The row that makes a decode batch's storage is placed as each layer is allocated, its own layer released
    once copied: when a layer's storage is allocated, the row's earlier layers are gone, so the placement never
    holds the whole row beside the whole storage (a full cache's first placement doubled its memory). The
    storage rows are the row's."""
    from kvbench.cache import CompressedLayer
    from kvbench.engine import Session
    from kvbench.methods.full import Full

    engine = Engine(tiny_model, Full(), Budget("fraction", 1.0))
    row = engine.prefill_row(random_prompts([300], tiny_model.config.vocab_size)[0], max_new_tokens=4)
    before = [(layer.kv.keys[:, :, :layer.longest].clone(), layer.kv.values[:, :, :layer.longest].clone(),
               layer.kv.positions[:, :, :layer.longest].clone(), layer.longest) for layer in row.cache.layers]
    held = []  # at each layer's allocation: which of the row's layers it still holds
    allocate = CompressedLayer.allocate

    def recording(layer, like, batch, capacity):
        held.append([theirs.kv is not None for theirs in row.cache.layers])
        return allocate(layer, like, batch, capacity)

    monkeypatch.setattr(CompressedLayer, "allocate", recording)
    session = Session.allocate(row, 2, engine.batch_capacities(row, 4), first=[0, 1])
    assert held == [[True, True], [False, True]] and all(layer.kv is None for layer in row.cache.layers)
    for layer, (keys, values, positions, length) in zip(session.cache.layers, before):
        for slot in (0, 1):
            assert torch.equal(layer.kv.keys[slot, :, :length], keys[0])
            assert torch.equal(layer.kv.values[slot, :, :length], values[0])
            assert torch.equal(layer.kv.positions[slot, :, :length], positions[0])
        assert layer.host_lengths.tolist() == [[length] * keys.shape[1]] * 2
    assert session.next_index.tolist() == row.next_index.tolist() * 2 and session.prompt_lengths == [300, 300]
