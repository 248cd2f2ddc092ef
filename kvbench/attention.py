"""The attention function kvbench registers with transformers' ``AttentionInterface``.

No modeling file is copied and no forward is patched: ``attach`` registers ``kvbench_<impl>`` (wrapping the
configured implementation: eager, sdpa or flash_attention_2) and switches the model to it for the duration
of a ``with`` block. The function receives the ``CompressedCache`` through the ``kvbench_cache`` keyword,
which the engine passes to the model's forward and transformers forwards to attention.

Paths, chosen per layer and pass:
- the first pass over an empty cache (prefill) runs the wrapped implementation with transformers' own mask,
  so the full-cache method is numerically identical to plain ``generate``;
- a pass over a cache whose rows are all full and aligned runs the wrapped implementation unmasked (decode);
- anything ragged (compressed per-head lengths, batch rows of different lengths), or a cache whose method
  keeps a per-slot ``logit_bias`` state (log-degree of merged slots), runs ``ragged_attention`` with a
  per-head mask built from stored positions and the bias added to the logits;
- statistics the method declared are computed by ``ragged_attention`` without materialising n x n.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvbench.errors import ConfigError
from kvbench.kernels.attention_stats import ragged_attention
from kvbench.kv import LOGIT_BIAS, AttentionStats

BASE_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")


def _eager(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout)


def _base_function(impl: str):
    if impl == "eager":
        return _eager
    if impl == "sdpa":
        return sdpa_attention_forward
    return ALL_ATTENTION_FUNCTIONS[impl]


def _make_attention(impl: str):
    base = _base_function(impl)

    def kvbench_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        cache = kwargs.pop("kvbench_cache", None)
        scaling = module.scaling if scaling is None else scaling
        if cache is None:
            return base(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        layer_idx = module.layer_idx
        layer = cache.layers[layer_idx]
        kv = layer.kv
        wanted = cache.wanted_stats
        query_pos = cache.pending_positions
        t = kv.max_length
        key_valid, key_pos = kv.valid()[:, :, :t], kv.positions[:, :, :t]
        aligned = bool((kv.lengths == t).all())
        no_padding = bool((query_pos >= 0).all())
        stats: dict = {}
        bias = kv.state.get(LOGIT_BIAS)
        if layer.fresh or (aligned and no_padding and query.shape[2] == 1 and not wanted and bias is None):
            mask = attention_mask if layer.fresh else None
            output, _ = base(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)
            if wanted - {"raw_keys"}:
                q, q_pos = query, query_pos
                if wanted & {"column_sums", "step_attention", "query_column_sums"} == set() and cache.window > 0:
                    # only the last `window` queries matter (left padding keeps them real): skip the rest
                    q, q_pos = query[:, :, -cache.window:], query_pos[:, -cache.window:]
                _, stats = ragged_attention(
                    q, key, None, key_valid, key_pos, q_pos, scaling,
                    window=cache.window, want_column_sums="column_sums" in wanted,
                    want_step="step_attention" in wanted, want_query_column_sums="query_column_sums" in wanted,
                )
        else:
            output, stats = ragged_attention(
                query, key, value, key_valid, key_pos, query_pos, scaling,
                window=cache.window if "window_column_sums" in wanted else 0,
                want_column_sums="column_sums" in wanted, want_step="step_attention" in wanted,
                key_bias=None if bias is None else bias[:, :, :t],
                want_query_column_sums="query_column_sums" in wanted,
            )
            output = output.transpose(1, 2).contiguous()
        n_real = (query_pos >= 0).sum(-1)
        # stats cover the first t slots; align them with the whole storage the method will receive
        cache.pass_stats[layer_idx] = AttentionStats(num_queries=n_real, **stats).aligned(kv.capacity)
        return output, None

    return kvbench_attention


def _register(impl: str) -> str:
    name = f"kvbench_{impl}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _make_attention(impl))
        mask_impl = "sdpa" if impl == "sdpa" else impl
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[mask_impl])
    return name


@contextmanager
def attach(model, impl: str):
    """Route the model's attention through kvbench for the duration of the block; restore it afterwards."""
    if impl not in BASE_IMPLEMENTATIONS:
        raise ConfigError(f"unknown attn_implementation '{impl}'; accepted: {', '.join(BASE_IMPLEMENTATIONS)}")
    previous = model.config._attn_implementation
    model.set_attn_implementation(_register(impl))
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def unrotate_keys(model, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Remove RoPE from cached keys (B, H, T, D) at their original positions (B, H, T).

    RoPE rotates each (x1, x2) pair by an angle; rotating by the negative angle gives the raw key back:
    raw = k*cos - rotate_half(k)*sin. Works for every rotate_half RoPE (Llama, Mistral, Qwen2), with scaling.
    """
    B, H, T, D = keys.shape
    rotary = model.model.rotary_emb
    cos, sin = rotary(keys, positions.clamp(min=0).reshape(B, H * T))
    cos, sin = cos.view(B, H, T, D).to(keys.dtype), sin.view(B, H, T, D).to(keys.dtype)
    half = D // 2
    rotated = torch.cat([-keys[..., half:], keys[..., :half]], dim=-1)
    return keys * cos - rotated * sin
