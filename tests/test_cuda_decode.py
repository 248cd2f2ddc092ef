"""Decoding on a GPU: CUDA graphs replay what eager steps compute, and a steady step never synchronises.

Skipped without CUDA (CI has none); the GPU runs (``scripts/gpu_session.sh``) run it on every method.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvbench import engine as engine_module
from kvbench.budget import Budget
from kvbench.decode import DecodeBatch, DecodeRequest
from kvbench.engine import Engine, Session
from kvbench.graphs import DecodeGraph
from tests.conftest import tiny_model_config
from tests.test_decode_batch import LENGTHS, requests_for, run
from tests.test_decode_paths import CASES, build, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def cuda_model():
    from kvbench import models

    return models.load(tiny_model_config(device="cuda")).model


def decode(engine: Engine, prompts, steps: int, tokens: list | None = None, graphs: bool = False,
           session: Session | None = None):
    """Logits of every step; feeds ``tokens`` when given (teacher forcing), else the argmax. From ``session``
    when given (prefilled for ``steps + 1`` tokens), else from a new prefill."""
    session = engine.prefill(prompts, max_new_tokens=steps + 1) if session is None else session
    fed = torch.zeros(len(prompts), 1, dtype=torch.long, device=engine.device)
    runner = DecodeGraph([session], lambda static: session.feed(fed, "decode", static)) if graphs else None
    logits, chosen = [], []
    for i in range(steps):
        if runner is not None:
            runner.flush()  # the session's logits are the last replay's
        logits.append(session.logits.float().clone())
        token = session.logits.argmax(-1) if tokens is None else tokens[i]
        chosen.append(token)
        fed.copy_(token.view(-1, 1))
        if runner is None:
            session.feed(fed)
        else:
            runner.step()
    return logits, chosen, runner


@pytest.mark.parametrize("name", CASES)
def test_cuda_graph_steps_compute_what_eager_steps_compute(cuda_model, name):
    prompts = random_prompts([45, 30], cuda_model.config.vocab_size)
    engine = Engine(cuda_model, build(name), Budget("tokens", 12))
    eager, tokens, _ = decode(engine, prompts, 16)
    graphed, _, runner = decode(engine, prompts, 16, tokens, graphs=True)
    for a, b in zip(eager, graphed):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    method = engine.method
    # a step repeats (and replays) unless the method compresses through ``compress`` at every step
    repeats = method.evicts_in_place or not method.compress_during_decode or method.decode_interval > 1
    assert (runner.replays > 0) == repeats


@pytest.mark.parametrize("name", CASES)
def test_layer_lanes_change_no_bit(cuda_model, name, monkeypatch):
    """The layers' observations and in-place evictions spread over side streams (``LAYER_STREAMS``) give the
    logits of the step that runs them in line, bit for bit, eager and replayed (the same kernels on the same
    tensors: only their order across layers changes). Every run decodes a copy of one prefill: prompt
    compressions that merge through float atomic adds differ from run to run in the last bits. Where two
    in-line runs already differ (decode-time compressions with atomic adds: Chelsea's, some of EMS's), the lanes
    are held to what the in-line runs give each other (the eager-vs-graph tolerance)."""
    assert engine_module.LAYER_STREAMS > 1
    prompts = random_prompts([45, 30], cuda_model.config.vocab_size)
    engine = Engine(cuda_model, build(name), Budget("tokens", 12))
    prefilled = engine.prefill(prompts, max_new_tokens=17)

    def run(streams: int, graphs: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(engine_module, "LAYER_STREAMS", streams)
        session = copy.deepcopy(prefilled, memo={id(engine): engine, id(prefilled.timer): prefilled.timer})
        return decode(engine, prompts, 16, graphs=graphs, session=session)[0]

    for graphs in (False, True):
        in_line, again, lanes = run(1, graphs), run(1, graphs), run(engine_module.LAYER_STREAMS, graphs)
        deterministic = all(torch.equal(a, b) for a, b in zip(in_line, again))
        tolerance = {"atol": 0, "rtol": 0} if deterministic else {"atol": 1e-4, "rtol": 1e-4}
        for a, b in zip(in_line, lanes):
            torch.testing.assert_close(b, a, **tolerance)


def test_a_batch_of_every_point_decodes_the_same_tokens_replayed_and_eager(cuda_model):
    """Continuous batching of every method as points of one graph-replayed step: the tokens of the eager step
    (float32 tiny model: the same kernels, so the same argmax)."""
    prompts = random_prompts(LENGTHS, cuda_model.config.vocab_size)
    outputs = {}
    for graphs in (False, True):
        engines = [Engine(cuda_model, build(name), Budget("tokens", 12), cuda_graphs=graphs) for name in CASES]
        rows = [(point, engine.prefill_row(prompt, request.max_new_tokens), request)
                for point, engine in enumerate(engines)
                for prompt, (request, _) in zip(prompts, requests_for(engine, prompts))]
        batch = DecodeBatch(engines, slots=2)
        outputs[graphs] = {tag: g.tokens for tag, g in run(batch, rows).items()}
    assert outputs[True] == outputs[False]
    assert batch.replays > 0


@pytest.mark.parametrize("name", CASES)
def test_steady_decode_step_does_not_synchronise(cuda_model, name):
    method = build(name)
    engine = Engine(cuda_model, method, Budget("tokens", 12))
    session = engine.prefill(random_prompts([45, 30], cuda_model.config.vocab_size), max_new_tokens=12)
    tokens = session.logits.argmax(-1).view(-1, 1)
    session.feed(tokens)
    for _ in range(3):
        due = method.compress_during_decode and (session.decode_steps + 1) % method.decode_interval == 0
        if due and not engine.in_place_eviction(1):
            session.feed(tokens)
            continue
        torch.cuda.set_sync_debug_mode("error")
        try:
            session.feed(tokens)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("graphs", [False, True])
def test_a_steady_batch_launch_does_not_synchronise(cuda_model, graphs):
    """A DecodeBatch step's launch (the step, its tokens' copy to pinned memory, the event): no synchronisation;
    only reading the previous step's tokens waits, for that step alone."""
    engine = Engine(cuda_model, build("h2o"), Budget("tokens", 12), cuda_graphs=graphs)
    rows = [(0, engine.prefill_row(p, 24), DecodeRequest(24))
            for p in random_prompts([45, 30], cuda_model.config.vocab_size)]
    batch = DecodeBatch([engine], slots=2)
    for tag, (point, row, request) in enumerate(rows):
        batch.admit(point, row, request, tag)
    for _ in range(4):  # admission, warm-up, capture
        batch.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            batch._launch()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    batch.close()


# methods whose prompt and decode compressions give the same bits run to run on CUDA (no merging atomic adds)
RUN_TO_RUN_EXACT = ["full", "streamingllm", "h2o", "snapkv", "tova", "d2o", "weightedkv"]


@pytest.mark.parametrize("name", RUN_TO_RUN_EXACT)
def test_a_row_is_placed_and_its_step_captured_while_its_prompt_pass_runs(cuda_model, monkeypatch, name):
    """``prefill_row(wait=False)``, then the placement and the first step of a row that its first token cannot
    end: it decodes the tokens of a row placed after waiting, and its prefill time comes from events. For H2O
    (a first step that is a capture: the shapes were warmed up) nothing there waits for the device (sync debug
    mode; torch.cuda.synchronize never called)."""
    engine = Engine(cuda_model, build(name), Budget("tokens", 12), cuda_graphs=True)
    prompt = random_prompts([45], cuda_model.config.vocab_size)[0]

    def decode_row(wait: bool, checked: bool = False):
        row = engine.prefill_row(prompt, 8, wait=wait)
        batch = DecodeBatch([engine], slots=1)
        batch.admit(0, row, DecodeRequest(8))
        if checked:
            calls = []
            monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: calls.append(args))
            torch.cuda.set_sync_debug_mode("error")
            try:
                batch.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
                monkeypatch.undo()
            assert batch.runner.kind == "capture" and calls == []
        return run(batch, [])[None], row

    waited, _ = decode_row(wait=True)  # warms the step's shapes up: the next batches capture at their first step
    queued, row = decode_row(wait=False, checked=name == "h2o")
    assert queued.tokens == waited.tokens
    assert 0 < row.prefill_seconds == queued.prefill_seconds
