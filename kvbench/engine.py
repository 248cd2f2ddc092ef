"""The engine: runs a HF causal LM through a ``CompressedCache`` and calls the method between passes.

    session = engine.prefill(prompts, max_new_tokens)   # prompt pass, then prefill compression
    session.feed(tokens)                                # suffix / teacher-forced / decode passes
    engine.generate(prompts, ...)                       # greedy decoding on top of the two

Batches are left-padded for the prompt pass; padding slots are dropped right after it, so rows are ragged
from then on and every row is computed exactly as it would be alone.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvbench.attention import attach, unrotate_keys
from kvbench.budget import Budget
from kvbench.cache import CompressedCache
from kvbench.errors import ConfigError
from kvbench.kv import AttentionStats
from kvbench.memory import PeakMemory
from kvbench.methods.base import Method

POSITION_MODES = ("original", "cache_length")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Process-wide peak so far. CUDA: max allocated since the last reset; CPU: peak RSS (ru_maxrss, KiB)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class Generation:
    """One sample's output and its measurements."""

    tokens: list[int]
    prompt_length: int
    kept_per_layer_head: list[list[int]]  # realized slots after prefill compression, [layer][head]
    n_keep: int  # requested slots per head after prefill (mean over layers if layer-adaptive)
    kv_bytes_full: int  # K+V bytes of the uncompressed prompt cache
    kv_bytes_compressed: int  # after prefill compression
    kv_bytes_final: int  # at the end of generation
    prefill_seconds: float  # time to first token: prompt pass + prefill compression + suffix
    compress_seconds: float  # prefill compression alone (inside prefill_seconds)
    decode_seconds: float  # all decode steps, decode-time compression included
    decode_compress_seconds: float  # decode-time compression alone (inside decode_seconds)
    tpot_seconds: float  # decode time per generated token (one batched decode step)
    peak_memory_bytes: int  # during this call: CUDA max allocated; CPU peak RSS growth (kvbench.memory)
    stopped_by: str  # "eos", "stop_string", "max_new_tokens"
    # mean over decode steps of the K+V bytes of the real slots that step's attention reads (all layers, this
    # row, the step's own new slot included): the KV term of the bytes-read bound on TPOT; NaN without decoding
    decode_kv_bytes_mean: float = float("nan")


@dataclass
class Session:
    """A batch's state in the compressed cache between passes."""

    engine: "Engine"
    cache: CompressedCache
    next_index: Tensor  # (B,) original index of each row's next token
    layer_n_keep: Tensor  # (L, B)
    logits: Tensor | None = None  # (B, V) logits of the last real token of the last pass
    decode_steps: int = 0
    prefill_lengths: Tensor | None = None  # (L, B, H) realized slots right after prefill compression
    compress_seconds: float = 0.0  # prefill compression
    decode_compress_seconds: float = 0.0
    timings: dict = field(default_factory=dict)

    def feed(self, tokens: Tensor, phase: str = "decode") -> Tensor:
        """Run ``tokens`` (B, q) through the model on top of the cache; returns logits (B, q, V).

        phase="decode": the method's decode-time compression runs after the pass (if enabled and due);
        phase="extend": no compression (e.g. the question appended after a compressed context).
        Methods that compress while decoding observe the attention of every pass, extend passes included,
        so that tokens fed in a chunk accumulate scores like decoded ones.
        """
        if phase not in ("decode", "extend"):
            raise ConfigError(f"unknown feed phase '{phase}'; accepted: decode, extend")
        engine, cache = self.engine, self.cache
        B, q = tokens.shape
        index = self.next_index.view(B, 1) + torch.arange(q, device=tokens.device)
        observing = engine.method.compress_during_decode
        cache.wanted_stats = engine.method.needed_stats("decode") if observing else frozenset()
        cache.window = engine.method.window
        logits = engine._forward(tokens, index, engine._rope_positions(cache, index), cache)
        self.next_index = self.next_index + q
        self.logits = logits[:, -1]
        if observing:
            self.decode_steps += phase == "decode"
            self._observe_and_compress(compress=phase == "decode")
        return logits

    def _observe_and_compress(self, compress: bool) -> None:
        start = time.perf_counter()
        with torch.inference_mode():  # the state tensors were made in inference mode; keep methods there
            self._observe_and_compress_layers(compress)
        _sync(self.engine.device)
        self.decode_compress_seconds += time.perf_counter() - start

    def _observe_and_compress_layers(self, compress: bool) -> None:
        engine, cache, method = self.engine, self.cache, self.engine.method
        for layer in range(len(cache.layers)):
            stats = engine._with_raw_keys(cache, layer, cache.pass_stats[layer], method.decode_needs)
            method.observe(layer, cache.kv(layer), stats)
            n_keep = self.layer_n_keep[layer]
            if compress and self.decode_steps % method.decode_interval == 0 and bool(
                (cache.kv(layer).lengths > n_keep.view(-1, 1)).any()
            ):
                cache.set_kv(layer, method.compress(layer, cache.kv(layer), stats, n_keep, "decode"))


class Engine:
    """model + method + budget. ``attn_implementation`` is the wrapped implementation (eager/sdpa/flash)."""

    def __init__(
        self,
        model,
        method: Method,
        budget: Budget,
        attn_implementation: str = "sdpa",
        position_mode: str = "original",
    ) -> None:
        if position_mode not in POSITION_MODES:
            raise ConfigError(f"unknown position_mode '{position_mode}'; accepted: {', '.join(POSITION_MODES)}")
        self.model = model
        self.method = method
        self.budget = budget
        self.attn_implementation = attn_implementation
        self.position_mode = position_mode
        self.num_layers = model.config.num_hidden_layers
        self.device = next(model.parameters()).device

    # -- passes ---------------------------------------------------------------------------------------

    def _rope_positions(self, cache: CompressedCache, index: Tensor) -> Tensor:
        """RoPE positions of new tokens: their original index, or (pos-shift style) the row's cache length."""
        if self.position_mode == "original" or cache.kv(0) is None:
            return index.clamp(min=0)
        start = cache.lengths().amax(dim=(0, 2))  # (B,)
        return start.view(-1, 1) + torch.arange(index.shape[1], device=index.device)

    def _forward(self, tokens: Tensor, index: Tensor, rope_positions: Tensor, cache: CompressedCache,
                 attention_mask: Tensor | None = None) -> Tensor:
        cache.pending_positions = index
        with torch.inference_mode(), attach(self.model, self.attn_implementation):
            out = self.model(
                input_ids=tokens,
                attention_mask=attention_mask,
                position_ids=rope_positions,
                past_key_values=cache,
                use_cache=True,
                kvbench_cache=cache,
            )
        return out.logits

    def _with_raw_keys(self, cache: CompressedCache, layer: int, stats, needs: frozenset[str]):
        if "raw_keys" in needs:
            kv = cache.kv(layer)
            stats.raw_keys = unrotate_keys(self.model, kv.keys, kv.positions)
        return stats

    def prefill(self, prompts: list[list[int]], max_new_tokens: int, pad_token_id: int = 0) -> Session:
        """Prompt pass over a left-padded batch, then prefill compression of every layer."""
        if any(len(p) == 0 for p in prompts):
            raise ConfigError("empty prompt: every sample needs at least one token")
        B, n = len(prompts), max(len(p) for p in prompts)
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        tokens = torch.full((B, n), pad_token_id, dtype=torch.long, device=self.device)
        mask = torch.zeros((B, n), dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            tokens[b, n - len(p):] = torch.tensor(p, device=self.device)
            mask[b, n - len(p):] = 1
        index = torch.arange(n, device=self.device).view(1, n) - (n - lengths).view(B, 1)
        index = index.masked_fill(mask == 0, -1)
        cache = CompressedCache(self.num_layers)
        cache.wanted_stats = self.method.needed_stats("prefill")
        cache.window = self.method.window
        _sync(self.device)
        start = time.perf_counter()
        logits = self._forward(tokens, index, index.clamp(min=0), cache, attention_mask=mask)
        cache.drop_padding()
        _sync(self.device)
        forward_seconds = time.perf_counter() - start
        kv_full = [layer.kv.nbytes() for layer in cache.layers]
        n_keep = self.budget.n_keep(lengths.cpu(), max_new_tokens, self.method.budget_basis).to(self.device)
        layer_n_keep = self.method.layer_budgets(n_keep, self.num_layers, cache.pass_stats,
                                                 max_new_tokens).to(self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            for layer in range(self.num_layers):
                stats = self._with_raw_keys(cache, layer, cache.pass_stats[layer], self.method.needs)
                kv = self.method.compress(layer, cache.kv(layer), stats, layer_n_keep[layer], "prefill")
                cache.set_kv(layer, kv)
                cache.pass_stats[layer] = AttentionStats()  # drop the prompt statistics once used
        _sync(self.device)
        session = Session(self, cache, next_index=lengths.clone(), layer_n_keep=layer_n_keep)
        session.logits = logits[:, -1]
        session.compress_seconds = time.perf_counter() - start
        session.timings = {"forward_seconds": forward_seconds, "kv_full": kv_full}
        session.prefill_lengths = cache.lengths().clone()
        return session

    # -- greedy generation ------------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        stop_token_ids: set[int],
        suffixes: list[list[int]] | None = None,
        min_new_tokens: int = 0,
        pad_token_id: int = 0,
        stop_when: Callable[[list[int]], bool] | None = None,
    ) -> list[Generation]:
        """Greedy decoding. ``suffixes`` (e.g. the question in query-agnostic mode) are fed after the prefill
        compression and never compressed at prefill; ``stop_token_ids`` end a row (not included in its output);
        ``stop_when(tokens)`` ends a row once it returns True for the row's output so far (stop strings)."""
        with PeakMemory(self.device) as peak:
            gens = self._generate(prompts, max_new_tokens, stop_token_ids, suffixes, min_new_tokens, pad_token_id,
                                  stop_when)
        for gen in gens:
            gen.peak_memory_bytes = peak.bytes
        return gens

    def _generate(self, prompts, max_new_tokens, stop_token_ids, suffixes, min_new_tokens, pad_token_id, stop_when):
        B = len(prompts)
        _sync(self.device)
        t0 = time.perf_counter()
        session = self.prefill(prompts, max_new_tokens, pad_token_id)
        kv_compressed = [self.cache_row_bytes(session.cache, b) for b in range(B)]
        if suffixes is not None:
            self._feed_ragged(session, suffixes, pad_token_id)
        for layer in session.cache.layers:
            layer.kv.reserve(max_new_tokens, exact=True)
        outputs: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        stopped = ["max_new_tokens"] * B
        stop = torch.tensor(sorted(stop_token_ids), dtype=torch.long, device=self.device)
        _sync(self.device)
        prefill_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        steps = 0
        kv_read = torch.zeros(B, dtype=torch.long, device=self.device)  # per row, summed over decode steps
        for step in range(max_new_tokens):
            logits = session.logits.float()
            if step < min_new_tokens and stop.numel():  # out of place: the logits are an inference tensor
                logits = logits.index_fill(1, stop, -float("inf"))
            next_tokens = logits.argmax(-1)
            for b in range(B):
                if done[b]:
                    continue
                token = int(next_tokens[b])
                if token in stop_token_ids:
                    done[b], stopped[b] = True, "eos"
                else:
                    outputs[b].append(token)
                    if stop_when is not None and stop_when(outputs[b]):
                        done[b], stopped[b] = True, "stop_string"
            if all(done) or step == max_new_tokens - 1:
                break
            kv_read += self._decode_read_bytes(session.cache)
            session.feed(next_tokens.view(B, 1), phase="decode")
            steps += 1
        _sync(self.device)
        decode_seconds = time.perf_counter() - t1
        kv_read_mean = (kv_read / steps).tolist() if steps else [float("nan")] * B
        return [
            Generation(
                tokens=outputs[b],
                prompt_length=len(prompts[b]),
                kept_per_layer_head=session.prefill_lengths[:, b].tolist(),
                n_keep=int(round(float(session.layer_n_keep[:, b].float().mean()))),
                kv_bytes_full=self._row_share(session.timings["kv_full"], b, prompts),
                kv_bytes_compressed=kv_compressed[b],
                kv_bytes_final=self.cache_row_bytes(session.cache, b),
                prefill_seconds=prefill_seconds / B,
                compress_seconds=session.compress_seconds / B,
                decode_seconds=decode_seconds / B,
                decode_compress_seconds=session.decode_compress_seconds / B,
                tpot_seconds=decode_seconds / max(1, steps),
                peak_memory_bytes=0,
                stopped_by=stopped[b],
                decode_kv_bytes_mean=kv_read_mean[b],
            )
            for b in range(B)
        ]

    def _feed_ragged(self, session: Session, suffixes: list[list[int]], pad_token_id: int) -> None:
        """Feed per-row suffixes of different lengths: left-pad them, then drop the padding slots."""
        B, q = len(suffixes), max(len(s) for s in suffixes)
        tokens = torch.full((B, q), pad_token_id, dtype=torch.long, device=self.device)
        index = torch.full((B, q), -1, dtype=torch.long, device=self.device)
        for b, s in enumerate(suffixes):
            if s:
                tokens[b, q - len(s):] = torch.tensor(s, device=self.device)
                index[b, q - len(s):] = session.next_index[b] + torch.arange(len(s), device=self.device)
        cache = session.cache
        observing = self.method.compress_during_decode
        cache.wanted_stats = self.method.needed_stats("decode") if observing else frozenset()
        cache.window = self.method.window
        logits = self._forward(tokens, index, self._rope_positions(cache, index.clamp(min=0)), cache)
        cache.drop_padding()
        if observing:
            session._observe_and_compress(compress=False)
        fed = torch.tensor([len(s) for s in suffixes], device=self.device)
        session.next_index = session.next_index + fed
        session.logits = torch.where((fed > 0).view(-1, 1), logits[:, -1], session.logits)

    @staticmethod
    def cache_row_bytes(cache: CompressedCache, b: int) -> int:
        return sum(layer.kv.nbytes(b) for layer in cache.layers)

    @staticmethod
    def _decode_read_bytes(cache: CompressedCache) -> Tensor:
        """(B,) K+V bytes the next decode step's attention reads per row: its real slots plus the slot the step
        appends to each head (counted before decode-time compression removes one). Stays on the device (no
        host sync inside the timed decode loop)."""
        total = 0
        for layer in cache.layers:
            kv = layer.kv
            per_slot = kv.allocated_bytes() // (kv.keys.numel() // kv.keys.shape[-1])
            total = total + (kv.lengths.sum(dim=1) + kv.lengths.shape[1]) * per_slot
        return total

    @staticmethod
    def _row_share(layer_bytes: list[int], b: int, prompts: list[list[int]]) -> int:
        """Uncompressed bytes of row b: the prompt pass stores every row's tokens in every head."""
        total_tokens = sum(len(p) for p in prompts)
        return int(sum(layer_bytes) * len(prompts[b]) / total_tokens)
