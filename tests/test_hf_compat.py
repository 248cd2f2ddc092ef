"""kvbench passes the model the cache keyword its transformers release takes, so no deprecation shim runs."""

from __future__ import annotations

import functools
import inspect
import warnings

from kvbench.budget import Budget
from kvbench.engine import Engine
from kvbench.hf_compat import cache_keyword
from kvbench.methods.h2o import H2O
from kvbench.methods.snapkv import SnapKV


def test_the_engine_passes_a_keyword_the_model_forward_names(tiny_model):
    keyword = cache_keyword(type(tiny_model))
    assert keyword in ("cache", "past_key_values")
    parameter = inspect.signature(type(tiny_model).forward).parameters[keyword]
    assert parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD


def test_the_new_name_wins_where_a_signature_has_it_seen_through_decorators():
    def renamed(function):  # as transformers' deprecate_kwarg: functools.wraps over the renamed forward
        @functools.wraps(function)
        def shim(*args, **kwargs):
            return function(*args, **kwargs)
        return shim

    class Newer:
        @renamed
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    class Floor:
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    assert cache_keyword(Newer) == "cache" and cache_keyword(Floor) == "past_key_values"


def test_prefill_and_decode_raise_no_deprecation_warning(tiny_model):
    """As ``python -W error::FutureWarning``: every pass kvbench makes (prompt, decode, compression while
    decoding, a suffix fed after the prompt) warns about nothing."""
    prompts = [list(range(3, 40)), list(range(5, 30))]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        Engine(tiny_model, H2O(), Budget("tokens", 12)).generate(prompts, max_new_tokens=4, stop_token_ids=set())
        Engine(tiny_model, SnapKV(), Budget("tokens", 12)).generate(prompts[:1], 3, set(), suffixes=[[7, 8, 9]])
