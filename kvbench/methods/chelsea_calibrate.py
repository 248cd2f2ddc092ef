"""Offline calibration of Chelsea's outlier heads (Chelsea §5.4, App. B).

    python -m kvbench.methods.chelsea_calibrate model=llama3.1-8b-instruct text=wiki.test.raw out=heads.json

Runs the model over sequences of a text (the paper: WikiText-2; ``text=`` takes any local file, by default a
generated WikiText-style text that only exercises the pipeline), builds the Chunked Soft Matching edges of
every KV head on the cached post-RoPE keys, prunes edges with similarity below ``calibration_threshold``, and
scores each head by the fraction of its A tokens left without an edge, averaged over sequences. The
``outlier_ratio`` of heads with the largest fractions (round half up) are the outliers.

Keys (all optional but model): model, text, out, outlier_ratio (0.04), calibration_threshold (0.5 [I]: the
paper's value is lost), sequence_length (4096), num_sequences (8), chunk_size / sinks / recent (Chelsea's
defaults), device, dtype. ``text=hub`` reads WikiText-2 (raw, test split) from the Hugging Face hub. Writes
JSON {"num_layers", "num_key_value_heads", "outlier_heads": [[layer, kv_head], ...], "scores", ...} for
``method.outlier_heads_file``.

As a step of an experiment (``conf/experiment/chelsea_longbench.yaml``): the Hydra callback
``CalibrateOutlierHeads`` runs this calibration in a chelsea job, before the run, when the job's
``method.outlier_heads_file`` does not exist yet, on the job's own model config and with the job's
sinks / recent / chunk size; later jobs of the same model reuse the file.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import torch
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from kvbench import models
from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.errors import ConfigError
from kvbench.kernels.matching import chunked_soft_matching
from kvbench.methods.chelsea import Chelsea
from kvbench.methods.full import Full
from kvbench.tasks.sources import DataRef, load_records

CONF = Path(__file__).resolve().parents[2] / "conf"
DEFAULTS = {"model": None, "text": None, "out": "chelsea_outlier_heads.json", "outlier_ratio": 0.04,
            "calibration_threshold": 0.5, "sequence_length": 4096, "num_sequences": 8, "chunk_size": 256,
            "sinks": 16, "recent": 64, "device": None, "dtype": None}
WIKITEXT2 = DataRef("Salesforce/wikitext", "wikitext-2-raw-v1", "test", files=("wikitext-2-raw-v1/test.jsonl",),
                    hub_file="wikitext-2-raw-v1/test-00000-of-00001.parquet")


def generated_text(num_paragraphs: int = 400, seed: int = 0) -> str:
    """A deterministic WikiText-style stand-in (headings and encyclopedic sentences) for smoke runs."""
    rng = random.Random(seed)
    subjects = ["The river", "The cathedral", "The regiment", "The album", "The species", "The railway",
                "The governor", "The festival", "The treaty", "The observatory"]
    verbs = ["was completed in", "was described in", "was expanded during", "was recorded in",
             "was renamed in", "was first mentioned in"]
    tails = ["after a long dispute over its funding", "according to contemporary accounts",
             "and attracted wide critical attention", "despite severe flooding in the region",
             "under the supervision of local authorities", "following the end of the war"]
    out = []
    for i in range(num_paragraphs):
        if i % 8 == 0:
            out.append(f" = {rng.choice(subjects)[4:]} of {rng.randrange(1200, 2000)} = \n")
        sentences = [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.randrange(1200, 2000)} {rng.choice(tails)}."
                     for _ in range(rng.randrange(3, 7))]
        out.append(" " + " ".join(sentences) + " \n")
    return "".join(out)


def edgeless_fraction(keys: torch.Tensor, threshold: float, chunk_size: int | None, sinks: int,
                      recent: int) -> torch.Tensor:
    """(B, H, T, D) keys of full rows -> (B, H) fraction of A tokens with no CSM edge of cosine >= threshold."""
    B, H, T, _ = keys.shape
    sinks = min(sinks, T)
    count = max(T - sinks - recent, 0)
    start = torch.full((B, H), sinks, dtype=torch.long, device=keys.device)
    partner, similarity = chunked_soft_matching(keys, start, torch.full_like(start, count), chunk_size)
    size = count if chunk_size is None else min(chunk_size, count)
    offset = torch.arange(T, device=keys.device) - sinks
    is_a = (offset >= 0) & (offset < count) & ((offset % max(size, 1)) % 2 == 0)
    kept = (similarity >= threshold) & is_a
    return 1 - kept.sum(-1).float() / max(int(is_a.sum()), 1)


def calibration_text(text: str | None) -> str:
    """``text``: a local file, "hub" (WikiText-2 raw test split from the hub, the paper's calibration set) or
    None (the generated stand-in)."""
    if text is None:
        return generated_text()
    if text == "hub":
        records, _ = load_records(WIKITEXT2, "hub", None, None, Path())
        return "".join(r["text"] for r in records)
    return Path(text).read_text()


def calibrate(cfg) -> dict:
    """Score every KV head and pick the outliers; returns the JSON-ready result."""
    if not 0 <= cfg.outlier_ratio <= 1:
        raise ConfigError(f"outlier_ratio={cfg.outlier_ratio} must be in [0, 1]")
    model_cfg = (OmegaConf.load(CONF / "model" / f"{cfg.model}.yaml") if isinstance(cfg.model, str)
                 else OmegaConf.create(OmegaConf.to_container(cfg.model, resolve=True)))  # a model config node
    for key in ("device", "dtype"):
        if cfg[key] is not None:
            model_cfg[key] = cfg[key]
    lm = models.load(model_cfg)
    Chelsea(sinks=cfg.sinks, recent=cfg.recent, chunk_size=cfg.chunk_size)  # validates the shared values
    text = calibration_text(cfg.text)
    ids = lm.encode(text)
    length = min(int(cfg.sequence_length), lm.max_length)
    windows = [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)][: int(cfg.num_sequences)]
    windows = windows or [ids[:length]]
    engine = Engine(lm.model, Full(), Budget("fraction", 1.0), model_cfg.attn_implementation)
    scores = None
    for window in windows:
        cache = engine.prefill([window], max_new_tokens=0).cache
        per_layer = torch.cat([edgeless_fraction(layer.kv.keys, cfg.calibration_threshold, cfg.chunk_size,
                                                 cfg.sinks, cfg.recent) for layer in cache.layers])  # (L, H)
        scores = per_layer if scores is None else scores + per_layer
    scores = (scores / len(windows)).cpu()
    L, H = scores.shape
    n_out = math.floor(cfg.outlier_ratio * L * H + 0.5)
    order = torch.sort(scores.flatten(), descending=True, stable=True).indices[:n_out]
    heads = sorted([int(i) // H, int(i) % H] for i in order)
    return {"model": lm.name, "num_layers": L, "num_key_value_heads": H, "outlier_heads": heads,
            "outlier_ratio": cfg.outlier_ratio, "calibration_threshold": cfg.calibration_threshold,
            "text": str(cfg.text) if cfg.text else "generated", "num_sequences": len(windows),
            "sequence_length": length, "chunk_size": cfg.chunk_size, "sinks": cfg.sinks, "recent": cfg.recent,
            "scores": [[round(float(x), 6) for x in row] for row in scores]}


class CalibrateOutlierHeads(Callback):
    """Hydra callback: before a chelsea job, calibrate its model's outlier heads into the job's
    ``method.outlier_heads_file`` unless that file exists. ``settings``: calibration keys of ``DEFAULTS``
    (text, outlier_ratio, calibration_threshold, sequence_length, num_sequences, device, dtype)."""

    def __init__(self, **settings) -> None:
        shared = {"model", "out", "chunk_size", "sinks", "recent"}  # taken from the job
        unknown = set(settings) - (set(DEFAULTS) - shared)
        if unknown:
            raise ConfigError(f"chelsea calibration callback: unknown settings {sorted(unknown)}; accepted: "
                              f"{sorted(set(DEFAULTS) - shared)}")
        self.settings = settings

    def on_job_start(self, config: DictConfig, **kwargs) -> None:
        method = config.method
        if not str(method.get("_target_", "")).endswith(".Chelsea") or method.get("outlier_heads_file") is None:
            return
        out = Path(method.outlier_heads_file)
        if out.is_file():
            return
        cfg = OmegaConf.merge(OmegaConf.create(DEFAULTS), OmegaConf.create(self.settings))
        cfg.model = OmegaConf.to_container(config.model, resolve=True)  # resolved inside the job's config
        cfg.out = str(out)
        cfg.chunk_size, cfg.sinks, cfg.recent = method.chunk_size, method.sinks, method.recent
        result = calibrate(cfg)
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(f".{out.name}.partial")
        partial.write_text(json.dumps(result, indent=1))
        partial.replace(out)  # atomic: a job never reads half a file


def main(argv: list[str]) -> None:
    cfg = OmegaConf.merge(OmegaConf.create(DEFAULTS), OmegaConf.from_dotlist(argv))
    unknown = set(cfg.keys()) - set(DEFAULTS)
    if unknown or cfg.model is None:
        raise ConfigError(f"chelsea_calibrate: bad keys {sorted(unknown)} or no model=; accepted: {sorted(DEFAULTS)}")
    result = calibrate(cfg)
    Path(cfg.out).write_text(json.dumps(result, indent=1))
    print(f"{len(result['outlier_heads'])} outlier heads of {result['num_layers']}x"
          f"{result['num_key_value_heads']} written to {cfg.out}: {result['outlier_heads']}")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as err:
        print(f"chelsea_calibrate: error: {err}", file=sys.stderr)
        sys.exit(2)
