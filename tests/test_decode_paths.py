"""The engine's decode fast paths against its reference path, for every shipped method (found by glob).

- ``evict_one`` (in place, one slot per step) keeps exactly the cache ``compress`` keeps, up to slot order,
  and generates the same tokens;
- a steady decode step reads nothing back from the device: no ``.item()``/``int()``/``bool()`` of a tensor
  (``aten._local_scalar_dense``), no data-dependent shapes (``nonzero``, boolean indexing), so a GPU never
  stalls the host and the step can be captured as a CUDA graph (the GPU run checks the same with
  ``torch.cuda.set_sync_debug_mode("error")``).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from torch.utils._python_dispatch import TorchDispatchMode

from kvbench import engine as engine_module
from kvbench.budget import Budget
from kvbench.engine import DECODE_PATHS, Engine
from kvbench.kernels.dispatch import use_backend
from kvbench.kv import AttentionStats, LayerKV

CONF = Path(__file__).resolve().parent.parent / "conf"
METHODS = sorted(p.stem for p in (CONF / "method").glob("*.yaml"))
# Small windows so that the tiny prompts exercise compression; every other value is the config's default.
OVERRIDES = {"chelsea": ["method.sinks=2", "method.recent=4", "method.chunk_size=8", "method.decode_interval=4"],
             "ems": ["method.window=4"], "snapkv": ["method.window=4"], "pyramidkv": ["method.window=4"]}
# case -> (method config, overrides): every method, plus variants whose decode step takes another code path.
CASES = {name: (name, OVERRIDES.get(name, [])) for name in METHODS} | {
    "cam_h2o": ("cam", ["method.eviction=h2o"]),
    "cam_h2o_merge4": ("cam", ["method.eviction=h2o", "method.merge_tokens=4"]),  # fewer targets than later slots
    "cam_deterministic": ("cam", ["method.deterministic=true", "method.merge_tokens=4"]),
    "h2o_mean": ("h2o", ["method.normalize=mean_over_observers"]),  # the score the step ranks is the mean too
    "d2o_layer_threshold": ("d2o", ["method.threshold_scope=layer"]),
    "d2o_code_mean": ("d2o", ["method.merge_rule=code_mean"]),
    "weightedkv_recent2": ("weightedkv", ["method.recent=2"]),
    # EMS: every TBM token merges (the look-up table fills and drops its oldest members), eviction only, no
    # first-level eviction, and the bias expansion with and without positions and multiplicity
    "ems_merge_all": ("ems", ["method.window=4", "method.tau=0"]),
    "ems_eviction_only": ("ems", ["method.window=4", "method.gamma=1"]),
    "ems_gamma_inf": ("ems", ["method.window=4", "method.gamma=inf", "method.tau=0.2", "method.similarity=key"]),
    "ems_bias": ("ems", ["method.window=4", "method.expansion=bias", "method.tau=0.2"]),
    "ems_bias_with_positions": ("ems", ["method.window=4", "method.expansion=bias", "method.positions=with",
                                        "method.tau=0", "method.similarity=value"]),
    "ems_bias_plain": ("ems", ["method.window=4", "method.expansion=bias", "method.multiplicity_bias=false",
                               "method.tau=0.1"]),
}
SYNCING_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique_dim",
               "aten::_unique2", "aten::repeat_interleave.Tensor"}


def build(case: str):
    config, overrides = CASES[case]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"method={config}", *overrides])
    return instantiate(cfg.method)


def random_prompts(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def table_entries(kv, b: int, h: int) -> list:
    """Row (b, h)'s used look-up-table entries (EMS) as sorted (position, centre, norm), whatever their order."""
    if "lut_position" not in kv.tables:
        return []
    position, centre, norm = (kv.tables[name][b, h].tolist() for name in ("lut_position", "lut_centre", "lut_norm"))
    return sorted((p, c, pytest.approx(n, rel=1e-5)) for p, c, n in zip(position, centre, norm) if p >= 0)


def by_position(kv, b: int, h: int) -> dict:
    """Row (b, h) of a layer's cache as position -> (key, value, state), whatever the slot order."""
    n = int(kv.lengths[b, h])
    return {int(kv.positions[b, h, s]): (kv.keys[b, h, s], kv.values[b, h, s],
                                         {k: float(v[b, h, s]) for k, v in sorted(kv.state.items())})
            for s in range(n)}


@pytest.mark.parametrize("name", [case for case in CASES if build(case).evicts_in_place])
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
                assert table_entries(fast.kv, b, h) == table_entries(ref.kv, b, h)


@pytest.mark.parametrize("name", ["h2o", "ems"])
@pytest.mark.parametrize("path", DECODE_PATHS)
def test_only_in_place_work_forks_during_the_pass(tiny_model, monkeypatch, name, path):
    """On a GPU, a decode pass forks each layer's observation and in-place eviction to a side stream right after the
    layer's attention (``LayerLanes``); a compression stays for after the pass, on the step's own stream (it
    allocates storage that the step goes on using). Here lanes that spread as on a GPU but run in line record the
    forks: layer l's eviction then runs before layer l + 1's forward, and every step's logits stay those of the
    step that evicts after the pass."""
    forks = []

    class InLine(engine_module.LayerLanes):
        def __init__(self, device, count):
            super().__init__(device, 1)
            self.spread = count > 1

        @contextmanager
        def fork(self, index):
            forks.append(index)
            yield

        def join(self):
            pass

    def decode(spread: bool) -> list[torch.Tensor]:
        if spread:
            monkeypatch.setattr(engine_module, "LayerLanes", InLine)
        engine = Engine(tiny_model, build(name), Budget("tokens", 12), decode_path=path)
        session = engine.prefill(random_prompts([45, 30], tiny_model.config.vocab_size), max_new_tokens=8)
        forks.clear()
        logits = [session.feed(session.logits.argmax(-1).view(-1, 1)) for _ in range(6)]  # an eviction at each
        return logits

    after_pass = decode(spread=False)
    in_pass = decode(spread=True)
    layers = tiny_model.config.num_hidden_layers
    assert forks == (list(range(layers)) * 6 if path == "in_place" else [])
    for a, b in zip(after_pass, in_pass):
        torch.testing.assert_close(b, a, atol=0, rtol=0)


@pytest.mark.parametrize("name", [case for case in CASES if build(case).evicts_in_place])
def test_in_place_eviction_under_random_attention(name):
    """The same comparison without a model: random attention per position at every step (the tiny model's
    near-uniform attention ranks slots by age, so CaM's merge probabilities would all be 1), checked after
    every step. WeightedKV draws attention from {0, 1/2, 1}: ties of a / n, which go to the oldest slot."""
    compare_under_random_attention(name, "torch")


def compare_under_random_attention(name: str, backend: str) -> None:
    """``compress`` (torch kernels) against ``observe`` + ``evict_one`` with ``backend``'s kernels, after every
    step of a random-attention decode (see the test above)."""
    method = build(name)
    g = torch.Generator().manual_seed(0)
    B, H, D, prompt, steps = 2, 2, 8, 30, 24
    n_keep = torch.tensor([12, 9])

    def attention(*shape):
        if method.name == "weightedkv":
            return torch.randint(0, 3, shape, generator=g).float() / 2
        return torch.rand(*shape, generator=g)

    kv = LayerKV.from_dense(torch.randn(B, H, prompt, D, generator=g), torch.randn(B, H, prompt, D, generator=g))
    scores = attention(B, H, prompt)
    prefill = AttentionStats(column_sums=scores, window_column_sums=scores, num_queries=torch.full((B,), prompt),
                             raw_keys=kv.keys)  # raw keys as they are (no RoPE)
    with use_backend("torch"):
        ref = method.compress(0, kv, prefill, n_keep, "prefill")
    fast = ref.gather(torch.arange(ref.capacity).expand(B, H, -1), ref.lengths.clone())
    fast.tables = {name: table.clone() for name, table in ref.tables.items()}  # updated in place
    fast.resize(ref.capacity + 1)
    fast.pack_state()  # the engine's decode storage
    for step in range(steps):
        keys, values = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
        position = torch.full((B, 1), prompt + step)
        step_attention = attention(B, H, prompt + step + 1)  # this step's attention to every token so far
        stats = []
        for kv in (ref, fast):
            kv.reserve(1)
            kv.write(keys, values, position)
            seen = step_attention.gather(2, kv.positions.clamp(min=0))
            stats.append(AttentionStats(step_attention=torch.where(kv.valid(), seen, 0.0), num_queries=torch.ones(B),
                                        one_query=True, raw_keys=kv.keys))  # a decode pass's, as the engine's
        with use_backend("torch"):
            method.observe(0, ref, stats[0])
            ref = method.compress(0, ref, stats[0], n_keep, "decode")
        with use_backend(backend):
            method.observe(0, fast, stats[1])
            method.evict_one(0, fast, stats[1], n_keep)
        assert fast.lengths.tolist() == ref.lengths.tolist()
        for b in range(B):
            for h in range(H):
                got, want = by_position(fast, b, h), by_position(ref, b, h)
                assert got.keys() == want.keys(), f"step {step}"
                for pos in want:
                    torch.testing.assert_close(got[pos][0], want[pos][0])
                    torch.testing.assert_close(got[pos][1], want[pos][1])
                    assert got[pos][2] == pytest.approx(want[pos][2], rel=1e-5, abs=1e-6, nan_ok=True)
                assert table_entries(fast, b, h) == table_entries(ref, b, h), f"step {step}"


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


@pytest.mark.parametrize("name", CASES)
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
