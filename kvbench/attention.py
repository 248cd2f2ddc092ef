"""The attention function kvbench registers with transformers' ``AttentionInterface``.

No modeling file is copied and no forward is patched: ``attach`` registers ``kvbench_<impl>`` (wrapping the
configured implementation: eager, sdpa or flash_attention_2) and switches the model to it for the duration
of a ``with`` block. The function receives the ``CompressedCache`` through the ``kvbench_cache`` keyword,
which the engine passes to the model's forward and transformers forwards to attention. No attention mask is
registered for it, so transformers builds none: every pass kvbench runs is unpadded (the engine prefills one
row at a time) and the paths below know their masking rule.

Paths, chosen per layer and pass from the cache's host mirror (never from a device value):
- the prompt pass over an empty layer runs the wrapped implementation, causally, so the full-cache method is
  numerically identical to plain ``generate``; when the method wants column sums over every query, the
  forward comes from an attention that also returns the log-sum-exp (cuDNN's on CUDA) and the statistics
  from one column-sum pass over Q and K with that lse: never a second attention; statistics of the last
  ``window`` queries alone take the window's lse apart; per-query-head sums (D2O) run the column-sum pass
  over the keys repeated to the query heads (the same work, one output row per query head);
- a one-query pass over rows of one common length, with no statistics and no per-slot bias, runs the wrapped
  implementation over the first ``length`` slots (decode as plain ``generate`` does it);
- any other one-query pass runs ``decode_attention`` (split-K over the storage, per-row lengths, optional
  per-slot ``logit_bias``, step attention from the same pass), over the whole capacity while a CUDA graph is
  captured;
- a pass of several queries over a non-empty cache (a suffix, a prompt chunk, a teacher-forced chunk) runs
  ``chunk_attention`` (FlashAttention-style: every cached slot, then the pass's own slots, which its write
  put last in every row, causally; per-row lengths and ``logit_bias``) and its statistics come from one
  column-sum pass with its lse, as the prompt pass's do; with a ``logit_bias`` and statistics (which the
  column-sum pass does not take) it runs ``ragged_attention`` with the causal rule on stored positions;
- a method that expands its stored slots at attention time (``Method.expands_slots``: EMS's look-up table)
  has the two cached paths above read its ``Method.expand`` entries instead, over their whole (static)
  capacity, the statistics summed back onto the stored slots (``Expansion.fold``); a one-query pass over
  entries that share their stored slot's key direction (``Expansion.members``: EMS "w.o. pos") runs
  ``lut_attention_at_centres`` over the stored slots and the members' (centre, norm) instead, with no view.
After the attention, the engine's ``after_layer`` hook (per-layer prompt compression) runs if it set one.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvbench.cache import CompositeCache, CompressedCache, CompressedLayer, PassPlan
from kvbench.errors import ConfigError
from kvbench.kernels.attention_stats import ragged_attention
from kvbench.kernels.chunk_attention import chunk_attention
from kvbench.kernels.column_sums import attention_lse, causal_attention_lse, column_sums_from_lse
from kvbench.kernels.decode_attention import decode_attention
from kvbench.kernels.lut_attention import lut_attention_at_centres
from kvbench.kv import LOGIT_BIAS, AttentionStats

BASE_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")
# Statistics the attention computes; raw_keys come from the stored keys when the method compresses.
ATTENTION_STATS = frozenset({"column_sums", "window_column_sums", "step_attention", "query_column_sums"})
EVERY_QUERY_STATS = ATTENTION_STATS - {"window_column_sums"}  # statistics that need every query's lse


def _eager(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from transformers.models.llama.modeling_llama import eager_attention_forward

    if attention_mask is None and query.shape[2] > 1:  # eager has no is_causal: the prompt pass needs a mask
        q = query.shape[2]
        attention_mask = torch.full((q, q), torch.finfo(query.dtype).min, dtype=query.dtype,
                                    device=query.device).triu(1)[None, None]
    return eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout)


def _base_function(impl: str):
    if impl == "eager":
        return _eager
    if impl == "sdpa":
        return sdpa_attention_forward
    return ALL_ATTENTION_FUNCTIONS[impl]


def _prompt_attention(base, module, query, key, value, scaling, plan: PassPlan, kwargs):
    """The first pass over an empty layer: causal attention of the prompt to itself, and its statistics, one
    dict per statistic set (the plan's own, then ``plan.stat_sets``, a prompt pass shared by several methods),
    each exactly as a pass asking for it alone computes it.

    Column sums over every query need every query's lse: the forward comes from ``causal_attention_lse`` when
    any set wants them (on the CPU it runs the kernel the wrapped sdpa runs: the same output to the bit).
    Statistics of the last ``window`` queries alone need only theirs: they are computed apart (a window of 32
    rows costs a few percent of a pass), also beside a forward that returned every query's lse."""
    sets = [(plan.wanted & ATTENTION_STATS, plan.window),
            *((wanted & ATTENTION_STATS, window) for wanted, window in plan.stat_sets)]
    B, Q = query.shape[0], query.shape[2]
    if any(wanted & EVERY_QUERY_STATS for wanted, _ in sets):
        output, lse = causal_attention_lse(query, key, value, scaling)
        output = output.transpose(1, 2).contiguous()
    else:
        output, _ = base(module, query, key, value, None, scaling=scaling, **kwargs)
        lse = None
    key_pos = plan.query_positions.view(B, 1, Q).expand(B, key.shape[1], Q)
    key_valid = torch.ones(key_pos.shape, dtype=torch.bool, device=key.device)
    passes = _column_sum_passes(sets)
    union: dict[tuple, frozenset[str]] = {}
    for key_of_pass, (wanted, _) in zip(passes, sets):
        union[key_of_pass] = union.get(key_of_pass, frozenset()) | wanted
    computed = {key_of_pass: _stats_from_lse(query, key, lse if wanted & EVERY_QUERY_STATS else None, key_valid,
                                             key_pos, scaling, plan.query_positions, wanted, key_of_pass[1])
                for key_of_pass, wanted in union.items() if wanted}
    return output, [{name: s for name, s in computed[key_of_pass].items() if name in wanted} if wanted else {}
                    for key_of_pass, (wanted, _) in zip(passes, sets)]


def _column_sum_passes(sets: list[tuple[frozenset[str], int]]) -> list[tuple]:
    """The column-sum pass that computes each (wanted, window) statistic set, as (what it is, window): sets over
    every query with GQA-averaged sums share one pass, because a pass's column sums do not depend on its window
    (the window's sums are a second accumulator of the same probabilities), so a set without a window joins the
    first one with a window (H2O's and EMS's sets: one pass a layer instead of two). Sets with another window,
    per-query-head sums (D2O) or the window's queries alone keep passes of their own."""
    passes = []
    for wanted, window in sets:
        window = window if "window_column_sums" in wanted else 0
        shared = bool(wanted & EVERY_QUERY_STATS) and "query_column_sums" not in wanted
        passes.append(("every query", window) if shared else (wanted, window))
    windowed = next((p for p in passes if p[0] == "every query" and p[1] > 0), None)
    return [windowed if windowed is not None and p == ("every query", 0) else p for p in passes]


def _stats_from_lse(query, key, lse, key_valid, key_pos, scaling, query_positions, wanted: frozenset[str],
                    window: int) -> dict:
    """The ``wanted`` statistics over ``key`` (B, H_kv, T) from one column-sum pass with the queries' lse
    (B, H_q, q) (or, when only the last ``window`` queries' statistics are wanted and ``lse`` is None, theirs
    computed apart); per-query-head sums (D2O) run it over the keys repeated to the query heads."""
    B, Hq, Q, _ = query.shape
    window = window if "window_column_sums" in wanted else 0
    q, q_pos = query, query_positions
    if not wanted & EVERY_QUERY_STATS:  # the window's queries alone
        q, q_pos = query[:, :, -window:], q_pos[:, -window:]
        lse = None if lse is None else lse[:, :, -window:]
    Hkv = key.shape[1]
    per_query_head = "query_column_sums" in wanted
    if per_query_head:  # every query head's own sums: its keys repeated, then averaged per group below
        key, key_valid, key_pos = (t.repeat_interleave(Hq // Hkv, dim=1) for t in (key, key_valid, key_pos))
    if lse is None:
        _, lse = attention_lse(q, key, None, key_valid, key_pos, q_pos, scaling)
    col, win = column_sums_from_lse(q, key, lse, key_valid, key_pos, q_pos, scaling, window=window)
    stats = {}
    if per_query_head:
        stats["query_column_sums"] = col
        col = col.view(B, Hkv, Hq // Hkv, -1).mean(2)
        win = None if win is None else win.view(B, Hkv, Hq // Hkv, -1).mean(2)
    if win is not None:
        stats["window_column_sums"] = win
    if "column_sums" in wanted:
        stats["column_sums"] = col
    if "step_attention" in wanted:
        stats["step_attention"] = col
    return stats


def _cached_attention(base, module, query, layer: CompressedLayer, scaling, plan: PassPlan, kwargs):
    """A pass over a layer that already holds tokens (this pass's tokens are written into it).

    A method that expands its stored slots (``Method.expand``) has attention read the expansion instead, over
    its whole capacity (the host knows no expanded length), with the statistics folded back onto the slots;
    one query over members of stored slots (``Expansion.members``) attends from the slots
    (``lut_attention_at_centres``).
    One query's step attention over the slots comes back pending (``AttentionStats.pending_step``): its last
    launch runs where the method observes, off the pass's critical path."""
    expansion = None if plan.expand is None else plan.expand(module.layer_idx, layer.kv,
                                                             position_limit=plan.position_limit)
    wanted = plan.wanted & ATTENTION_STATS
    q = query.shape[2]
    if q == 1 and expansion is not None and expansion.members is not None:  # no view: members from their slots
        members, kv = expansion.members, layer.kv
        output, step = lut_attention_at_centres(query, kv.keys, kv.values, kv.positions, kv.lengths, members.centre,
                                                members.norm, members.position_limit, scaling,
                                                want_step="step_attention" in wanted, defer_step=True)
        return output.transpose(1, 2), {} if step is None else {"pending_step": step}
    kv = layer.kv if expansion is None else expansion.kv
    static_shapes = plan.static_shapes or expansion is not None
    bias = kv.state.get(LOGIT_BIAS)
    if q == 1:
        aligned = None if static_shapes else layer.aligned
        if aligned is not None and bias is None and not wanted:
            output, _ = base(module, query, kv.keys[:, :, :aligned], kv.values[:, :, :aligned], None,
                             scaling=scaling, **kwargs)
            return output, {}
        span = kv.capacity if static_shapes else layer.longest
        output, step = decode_attention(query, kv.keys, kv.values, kv.lengths, kv.positions, plan.query_positions,
                                        scaling, span, want_step="step_attention" in wanted, key_bias=bias,
                                        defer_step=expansion is None)
        if expansion is not None:
            return output.transpose(1, 2), expansion.fold({} if step is None else {"step_attention": step},
                                                          layer.kv.capacity)
        return output.transpose(1, 2), {} if step is None else {"pending_step": step}
    t = kv.capacity if expansion is not None else layer.longest
    valid = torch.arange(t, device=query.device).view(1, 1, -1) < kv.lengths.unsqueeze(-1)
    if expansion is None and (bias is None or not wanted):  # this pass's tokens are every row's last q slots
        output, lse = chunk_attention(query, kv.keys, kv.values, kv.lengths, scaling, key_bias=bias)
        stats = _stats_from_lse(query, kv.keys[:, :, :t], lse, valid, kv.positions[:, :, :t], scaling,
                                plan.query_positions, wanted, plan.window) if wanted else {}
    else:  # expanded entries, or statistics with a logit bias (the column-sum pass takes none)
        output, stats = ragged_attention(
            query, kv.keys[:, :, :t], kv.values[:, :, :t], valid, kv.positions[:, :, :t], plan.query_positions,
            scaling, window=plan.window if "window_column_sums" in wanted else 0,
            want_column_sums="column_sums" in wanted, want_step="step_attention" in wanted,
            key_bias=None if bias is None else bias[:, :, :t],
            want_query_column_sums="query_column_sums" in wanted,
        )
    output = output.transpose(1, 2).contiguous()
    if expansion is not None:
        return output, expansion.fold(stats, layer.kv.capacity)
    pad = kv.capacity - t  # statistics are aligned with the whole storage the method receives
    return output, {name: F.pad(s, (0, pad)) for name, s in stats.items()}


def _make_attention(impl: str):
    base = _base_function(impl)

    def kvbench_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        cache: CompressedCache | CompositeCache | None = kwargs.pop("kvbench_cache", None)
        scaling = module.scaling if scaling is None else scaling
        if cache is None:
            return base(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if isinstance(cache, CompositeCache):  # several points' rows: each attends over its own storage
            return torch.cat([attend(module, query.narrow(0, start, rows), key.narrow(0, start, rows),
                                     value.narrow(0, start, rows), scaling, part, kwargs)
                              for start, rows, part in cache.partitions]), None
        return attend(module, query, key, value, scaling, cache, kwargs), None

    def attend(module, query, key, value, scaling, cache: CompressedCache, kwargs):
        layer_idx, plan = module.layer_idx, cache.plan
        layer = cache.layers[layer_idx]
        if layer.fresh:
            output, (stats, *shared) = _prompt_attention(base, module, query, key, value, scaling, plan, kwargs)
            cache.set_stats[layer_idx] = [AttentionStats(num_queries=plan.num_queries, **s) for s in shared]
        else:
            output, stats = _cached_attention(base, module, query, layer, scaling, plan, kwargs)
        cache.pass_stats[layer_idx] = AttentionStats(num_queries=plan.num_queries,
                                                     one_query=plan.query_positions.shape[1] == 1, **stats)
        if plan.after_layer is not None:
            plan.after_layer(layer_idx)
        return output

    return torch.compiler.disable(kvbench_attention)  # host decisions: compiled layers call it as it is


def _register(impl: str) -> str:
    name = f"kvbench_{impl}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _make_attention(impl))
    return name


@contextmanager
def attach(model, impl: str):
    """Route the model's attention through kvbench for the duration of the block; restore it afterwards.

    Re-entrant: inside an attached block (``Engine.generate`` wraps its whole loop) it does nothing, because
    switching an implementation walks the whole model (a third of a millisecond even for a 2-layer model)."""
    if impl not in BASE_IMPLEMENTATIONS:
        raise ConfigError(f"unknown attn_implementation '{impl}'; accepted: {', '.join(BASE_IMPLEMENTATIONS)}")
    previous, name = model.config._attn_implementation, _register(impl)
    if previous == name:
        yield
        return
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def _rope(model, keys: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The model's RoPE cos and sin at ``positions`` (B, H, T), and rotate_half(keys), each (B, H, T, D)."""
    B, H, T, D = keys.shape
    cos, sin = model.model.rotary_emb(keys, positions.reshape(B, H * T))
    cos, sin = cos.view(B, H, T, D).to(keys.dtype), sin.view(B, H, T, D).to(keys.dtype)
    half = D // 2
    return cos, sin, torch.cat([-keys[..., half:], keys[..., :half]], dim=-1)


class Rope:
    """A model's rotate-half RoPE as a method's kernel may take it off stored keys itself: EMS's decode step reads
    the raw keys of the slots it scans from the stored keys instead of an un-RoPE'd copy of the whole cache.

    ``unrotate(keys, positions)``: ``unrotate_keys``. ``frequencies``: (inv_freq (D/2,) float32, scaling) such that
    the model's cos and sin at position p are cos(p * inv_freq) * scaling and sin(p * inv_freq) * scaling in float32,
    rounded to the keys' dtype (the rotary embedding's forward), so that a kernel derives them in registers; None
    for RoPE types whose frequencies follow the sequence length (dynamic, longrope), which only ``unrotate`` takes.
    ``table(dtype)``: (cos, sin), each (P, D/2) in ``dtype``, the rotary embedding's own values at positions
    0..P-1 (P: the model's context, at most ``TABLE_POSITIONS``), one per model and dtype, so that a kernel reads
    them instead of computing two float32 transcendentals per key element (past P it computes them).
    """

    def __init__(self, model) -> None:
        self.model = model
        self.rotary = model.model.rotary_emb
        rope_type = getattr(self.rotary, "rope_type", "default")
        self.frequencies: tuple[torch.Tensor, float] | None = None
        if "dynamic" not in rope_type and rope_type != "longrope":
            self.frequencies = (self.rotary.inv_freq.float().contiguous(), float(self.rotary.attention_scaling))

    def unrotate(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return unrotate_keys(self.model, keys, positions)

    def table(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) at positions 0..P-1 in ``dtype``; made on the first call (not inside a CUDA graph's capture:
        the engine asks before any decode step)."""
        tables = _ROPE_TABLES.setdefault(self.rotary, {})
        if dtype not in tables:
            config = self.model.config
            count = min(getattr(config, "max_position_embeddings", TABLE_POSITIONS) or TABLE_POSITIONS,
                        TABLE_POSITIONS)
            inv_freq = self.rotary.inv_freq
            positions = torch.arange(count, device=inv_freq.device).view(1, count)
            cos, sin = self.rotary(torch.empty(0, dtype=dtype, device=inv_freq.device), positions)
            half = inv_freq.shape[0]
            tables[dtype] = (cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous())
        return tables[dtype]


TABLE_POSITIONS = 131072  # at most this many positions in a ``Rope.table`` (Llama 3.1's context: 32 MiB in bf16)
_ROPE_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # rotary module -> dtype -> (cos, sin)


def unrotate_keys(model, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Remove RoPE from cached keys (B, H, T, D) at their original positions (B, H, T).

    RoPE rotates each (x1, x2) pair by an angle; rotating by the negative angle gives the raw key back:
    raw = k*cos - rotate_half(k)*sin. Works for every rotate_half RoPE (Llama, Mistral, Qwen2), with scaling.
    """
    cos, sin, rotated = _rope(model, keys, positions.clamp(min=0))
    return keys * cos - rotated * sin


def rotate_keys(model, keys: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rotate keys (B, H, T, D) further by RoPE at ``offsets`` (B, H, T), of any sign: rotations compose, so a
    key RoPE'd at p comes out RoPE'd at p + offset (times the RoPE's attention scaling, which callers that keep
    norms divide out)."""
    cos, sin, rotated = _rope(model, keys, offsets)
    return keys * cos + rotated * sin
