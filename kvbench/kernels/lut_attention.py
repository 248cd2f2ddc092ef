"""One decode query's attention over EMS's stored slots and their look-up-table members without expanding them
("w.o. pos", ``methods.ems``): the step's output and its attention per stored slot, reading K and V once.

Member j of the stored slot c (its centre) stands for the key ||k_j|| * unit(k_c) and the value v_c. Its logit
is s q.(||k_j|| unit(k_c)) = rho_j l_c, with l_c = s q.k_c the slot's own logit and rho_j = ||k_j|| / ||k_c||,
so the softmax over slots and members is one over slots with slot c weighing
    W_c = exp(l_c - M) + sum over c's live members j of exp(rho_j l_c - M)       (M: the largest logit of both)
output = sum_c W_c v_c / sum_c W_c, and the attention the expanded view's entries of slot c would get, summed
(what ``Expansion.fold`` gives a method), is W_c / sum_c W_c.

Against the view (``lut_expand.expand_lut`` then ``decode_attention``, then ``fold_entries``) the only
difference is rounding: the view stores ||k_j|| unit(k_c) in the cache's dtype before the dot product, here
rho_j multiplies the float32 logit; so the two agree to float32 rounding on a float32 cache and to the cache
dtype's rounding of a member key (2^-8 relative on bfloat16, times the logit) on a half cache.

Shapes: query (B, H_q, 1, D), H_q = g * H (GQA: query head hq reads KV head hq // g); keys (B, H, T, D), values
(B, H, T, D_v); lengths (B, H) long (slots [0, length) are real); member_slot (B, H, E) long, the stored slot
of each member's centre (any slot in [0, T) where not live); member_norm (B, H, E) float32 ||k_j||; live (B, H, E)
bool. Returns the output (B, H_q, 1, D_v) in the query's dtype and, with ``want_step``, the step attention
(B, H, T) float32 averaged over the query heads of a group (``decode_attention``'s convention), else None;
``defer_step``: as a callable that computes it, or with ``into=`` adds it to a float32 tensor
(``AttentionStats.pending_step``).
Shapes are static (no host read): the step replays in a CUDA graph.

This is the torch reference; ``triton_lut_attention`` holds the four-launch kernel of the same signature.
``lut_attention_at_centres`` takes the members by their centres' positions, as a decode step holds them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kvbench.kernels.attention_stats import pending_step
from kvbench.kernels.dispatch import use_triton
from kvbench.kernels.lut_expand import centre_slots

NORM_EPS = 1e-12  # F.normalize's: a zero centre key gives its members zero keys, as the view's unit_keys does


def lut_attention(query: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, member_slot: Tensor,
                  member_norm: Tensor, live: Tensor, scaling: float, want_step: bool = False, defer_step: bool = False,
                  ) -> tuple[Tensor, Tensor | Callable[..., Tensor] | None]:
    if use_triton("lut_attention", query):
        from kvbench.kernels import triton_lut_attention

        return triton_lut_attention.lut_attention(query, keys, values, lengths, member_slot, member_norm, live,
                                                  scaling, want_step, defer_step)
    B, Hq, _, D = query.shape
    H, T = keys.shape[1], keys.shape[2]
    g = Hq // H
    real = torch.arange(T, device=keys.device) < lengths.unsqueeze(-1)  # (B, H, T)
    logits = torch.einsum("bhgd,bhtd->bhgt", query.view(B, H, g, D).float(), keys.float()) * scaling
    logits = logits.masked_fill(~real.unsqueeze(2), -torch.inf)  # (B, H, g, T)
    rho = member_norm.float() / keys.float().norm(dim=-1).clamp(min=NORM_EPS).gather(-1, member_slot)  # (B, H, E)
    at_centre = logits.gather(-1, member_slot.unsqueeze(2).expand(-1, -1, g, -1))
    member_logits = torch.where(live.unsqueeze(2), at_centre * rho.unsqueeze(2), -torch.inf)  # (B, H, g, E)
    top = torch.cat([logits, member_logits], -1).amax(-1, keepdim=True)
    top = torch.where(top == -torch.inf, 0.0, top)  # an empty row: no weight anywhere, output 0
    weights = torch.exp(logits - top).scatter_add(-1, member_slot.unsqueeze(2).expand(-1, -1, g, -1),
                                                   torch.exp(member_logits - top))
    probs = weights / weights.sum(-1, keepdim=True).clamp(min=1e-30)  # >= 1 on a row with a real slot
    out = torch.einsum("bhgt,bhtd->bhgd", probs, values.float()).reshape(B, Hq, 1, -1).to(query.dtype)
    if not want_step:
        return out, None
    step = probs.mean(2)
    return out, pending_step(step) if defer_step else step


def lut_attention_at_centres(query: Tensor, keys: Tensor, values: Tensor, positions: Tensor, lengths: Tensor,
                             centre: Tensor, member_norm: Tensor, position_limit: int | None, scaling: float,
                             want_step: bool = False, defer_step: bool = False,
                             ) -> tuple[Tensor, Tensor | Callable[..., Tensor] | None]:
    """``lut_attention`` with the members given by their centres' positions ``centre`` (B, H, E) long (-1: unused),
    their slots found as ``lut_expand.centre_slots`` finds them (``positions`` (B, H, T) the stored slots',
    ``position_limit`` its bound or None): what a decode step holds (``kv.CentreMembers``). Given the bound, the
    Triton kernel finds them inside its own launches (``triton_lut_attention.lut_attention_at_centres``); the same
    slots, so the same output and step attention as ``centre_slots`` then ``lut_attention``."""
    if position_limit is not None and use_triton("lut_attention", query):
        from kvbench.kernels import triton_lut_attention

        return triton_lut_attention.lut_attention_at_centres(query, keys, values, positions, lengths, centre,
                                                             member_norm, position_limit, scaling, want_step,
                                                             defer_step)
    slot, live = centre_slots(positions, lengths, centre, position_limit)
    return lut_attention(query, keys, values, lengths, slot, member_norm, live, scaling, want_step, defer_step)
