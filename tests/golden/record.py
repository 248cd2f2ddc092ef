"""Record every method's decoding on the tiny model: the reference that guards the engine's fast paths.

``python tests/golden/record.py`` writes ``tests/golden/decode_tokens.json``; ``tests/test_golden_tokens.py``
replays the same scenarios and requires the same tokens and realized cache sizes. The file was first written
by the engine before the static-capacity / in-place rewrite (commit 3324ebb), each ``batch`` row generated
alone: that engine's left-padded batch prompt pass differed from its rows alone by float rounding, enough to
flip SnapKV's, PyramidKV's and EMS-with-positions' choices in 4 of the 19 cases; the engine now prefills one
row at a time, so a batch equals its rows by construction. A re-record is legitimate only when a method's
*semantics* change on purpose, and the commit that does it says which methods and why.

Scenarios (tiny random model, float32, CPU, torch kernels):
- ``batch``: two prompts of 61 and 40 tokens together (ragged rows), 24 greedy tokens;
- ``suffix``: a 50-token context compressed alone, then a 7-token suffix fed uncompressed, 16 tokens;
- ``feed``: a 30-token prompt, then 4 passes of 5 teacher-forced tokens and 6 passes of 1 (decode phase),
  the argmax after every fed position (the PG19 chunked/streaming protocols).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
OUT = HERE / "decode_tokens.json"

# name -> (method config, overrides): every shipped method with its defaults, plus variants that reach the
# other code paths (decode intervals > 1, biased attention, H2O-driven CaM, EMS with positions).
CASES = {name: (name, []) for name in ("full", "streamingllm", "h2o", "snapkv", "pyramidkv", "tova", "cam", "d2o",
                                       "kvmerger", "ems", "weightedkv", "chelsea")}
CASES.update({
    "h2o_interval3": ("h2o", ["method.decode_interval=3"]),
    "cam_h2o": ("cam", ["method.eviction=h2o"]),
    "ems_with_positions": ("ems", ["method.positions=with", "method.window=4"]),
    "ems_bias": ("ems", ["method.expansion=bias"]),
    "kvmerger_proportional": ("kvmerger", ["method.value_scaling=proportional", "method.epsilon=0.1"]),
    "kvmerger_merging": ("kvmerger", ["method.epsilon=0.1"]),
    "chelsea_interval4": ("chelsea", ["method.sinks=2", "method.recent=4", "method.chunk_size=8",
                                      "method.decode_interval=4"]),
    "snapkv_window4": ("snapkv", ["method.window=4"]),
    "tova_per_head": ("tova", ["method.head_average=false"]),
})


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def build_method(config: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"method={config}", *overrides])
    return instantiate(cfg.method)


def run_case(model, name: str) -> dict:
    from kvbench.budget import Budget
    from kvbench.engine import Engine

    config, overrides = CASES[name]
    method = build_method(config, overrides)
    vocab = model.config.vocab_size
    out = {}
    engine = Engine(model, method, Budget("fraction", 0.3))
    gens = engine.generate(random_prompts([61, 40], vocab, 0), max_new_tokens=24, stop_token_ids=set())
    out["batch"] = {"tokens": [g.tokens for g in gens], "kept": [g.kept_per_layer_head for g in gens],
                    "kv_bytes_final": [g.kv_bytes_final for g in gens]}
    engine = Engine(model, method, Budget("tokens", 16))
    context, suffix = random_prompts([50, 7], vocab, 1)
    gen = engine.generate([context], max_new_tokens=16, stop_token_ids=set(), suffixes=[suffix])[0]
    out["suffix"] = {"tokens": gen.tokens, "kept": gen.kept_per_layer_head, "kv_bytes_final": gen.kv_bytes_final}
    engine = Engine(model, method, Budget("tokens", 12))
    (ids,) = random_prompts([56], vocab, 2)
    session = engine.prefill([ids[:30]], max_new_tokens=26)
    argmax, start = [], 30
    for q in [5, 5, 5, 5, 1, 1, 1, 1, 1, 1]:
        logits = session.feed(torch.tensor([ids[start:start + q]]), phase="decode")
        argmax.extend(logits[0].argmax(-1).tolist())
        start += q
    out["feed"] = {"argmax": argmax, "lengths": session.cache.lengths()[:, 0].tolist()}
    return out


def record(names: list[str]) -> dict:
    from kvbench import models
    from kvbench.kernels.dispatch import use_backend
    from omegaconf import OmegaConf

    model = models.load(OmegaConf.load(REPO / "conf" / "model" / "tiny-llama-random.yaml")).model
    with use_backend("torch"):
        return {name: run_case(model, name) for name in names}


if __name__ == "__main__":
    names = sys.argv[1:] or list(CASES)
    existing = json.loads(OUT.read_text()) if OUT.exists() else {}
    existing.update(record(names))
    lines = [f"{json.dumps(name)}: {json.dumps(existing[name], sort_keys=True)}" for name in sorted(existing)]
    OUT.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # one case per line: reviewable diffs
    print(f"wrote {len(names)} cases to {OUT}")
