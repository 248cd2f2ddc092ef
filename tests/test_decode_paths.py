"""The engine's decode fast paths against its reference path, for every shipped method (found by glob).

- ``evict_one`` (in place, one slot per step) keeps exactly the cache ``compress`` keeps, up to slot order,
  and generates the same tokens;
- a steady decode step reads nothing back from the device: no ``.item()``/``int()``/``bool()`` of a tensor
  (``aten._local_scalar_dense``), no data-dependent shapes (``nonzero``, boolean indexing), so a GPU never
  stalls the host and the step can be captured as a CUDA graph (the GPU run checks the same with
  ``torch.cuda.set_sync_debug_mode("error")``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from torch.utils._python_dispatch import TorchDispatchMode

from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.kernels.dispatch import use_backend

CONF = Path(__file__).resolve().parent.parent / "conf"
METHODS = sorted(p.stem for p in (CONF / "method").glob("*.yaml"))
# Small windows so that the tiny prompts exercise compression; every other value is the config's default.
OVERRIDES = {"chelsea": ["method.sinks=2", "method.recent=4", "method.chunk_size=8", "method.decode_interval=4"],
             "ems": ["method.window=4"], "snapkv": ["method.window=4"], "pyramidkv": ["method.window=4"]}
SYNCING_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique_dim",
               "aten::_unique2", "aten::repeat_interleave.Tensor"}


def build(name: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"method={name}", *OVERRIDES.get(name, [])])
    return instantiate(cfg.method)


def random_prompts(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def by_position(kv, b: int, h: int) -> dict:
    """Row (b, h) of a layer's cache as position -> (key, value, state), whatever the slot order."""
    n = int(kv.lengths[b, h])
    return {int(kv.positions[b, h, s]): (kv.keys[b, h, s], kv.values[b, h, s],
                                         {k: float(v[b, h, s]) for k, v in sorted(kv.state.items())})
            for s in range(n)}


@pytest.mark.parametrize("name", [m for m in METHODS if build(m).evicts_in_place])
def test_in_place_eviction_keeps_what_compress_keeps(tiny_model, name):
    method = build(name)
    prompts = random_prompts([45, 30], tiny_model.config.vocab_size)
    caches, tokens = {}, {}
    with use_backend("torch"):
        for path in ("in_place", "compress"):
            engine = Engine(tiny_model, method, Budget("tokens", 12), decode_path=path)
            session = engine.prefill(prompts, max_new_tokens=20)
            out = []
            for _ in range(20):
                step = session.logits.argmax(-1)
                out.append(step.tolist())
                session.feed(step.view(-1, 1))
            caches[path], tokens[path] = session.cache, out
    assert tokens["in_place"] == tokens["compress"]
    assert not any(layer.ordered for layer in caches["in_place"].layers)  # the in-place path really ran
    for fast, ref in zip(caches["in_place"].layers, caches["compress"].layers):
        assert fast.kv.lengths.tolist() == ref.kv.lengths.tolist()
        for b in range(2):
            for h in range(fast.kv.lengths.shape[1]):
                got, want = by_position(fast.kv, b, h), by_position(ref.kv, b, h)
                assert got.keys() == want.keys()
                for pos in want:
                    torch.testing.assert_close(got[pos][0], want[pos][0])
                    torch.testing.assert_close(got[pos][1], want[pos][1])
                    assert got[pos][2] == pytest.approx(want[pos][2], rel=1e-5, abs=1e-6)


class HostReads(TorchDispatchMode):
    """Records every operator that makes the host wait for the device's result."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name + ("." + func._overloadname if func._overloadname != "default" else "")
        bool_index = func is torch.ops.aten.index.Tensor and any(
            i is not None and i.dtype == torch.bool for i in args[1])
        if name in SYNCING_OPS or func._schema.name in SYNCING_OPS or bool_index:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", METHODS)
def test_steady_decode_step_never_waits_for_the_device(tiny_model, name):
    method = build(name)
    engine = Engine(tiny_model, method, Budget("tokens", 12))
    with use_backend("torch"):
        session = engine.prefill(random_prompts([45, 30], tiny_model.config.vocab_size), max_new_tokens=12)
        tokens = session.logits.argmax(-1).view(-1, 1)
        session.feed(tokens)  # leave the prefill state: every row now decodes at its budget
        for _ in range(3):
            due = method.compress_during_decode and (session.decode_steps + 1) % method.decode_interval == 0
            steady = not due or engine.in_place_eviction(1)
            with HostReads() as reads:
                session.feed(tokens)
            if steady:
                assert reads.seen == [], f"{name}: a decode step read the device: {reads.seen}"


def test_host_reads_are_detected():
    x = torch.arange(6.0)
    with HostReads() as reads:
        int(x.max())
        x[x > 2].sum()
    assert reads.seen == ["aten::_local_scalar_dense", "aten::index.Tensor"]
