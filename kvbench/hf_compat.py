"""Where transformers' model API differs between the releases kvbench supports (5.17, the floor, to the newest).

transformers 5.24 renamed the model forward's cache keyword ``past_key_values`` to ``cache``; the old name still
works there through a deprecation shim that warns on every call and goes away in 5.40.
"""

from __future__ import annotations

import functools
import inspect

NEW_CACHE_KEYWORD, OLD_CACHE_KEYWORD = "cache", "past_key_values"


@functools.cache
def cache_keyword(model_class: type) -> str:
    """The keyword ``model_class.forward`` takes its cache by: the new name where the signature has it (the
    signature seen through transformers' decorators), else the old one. Decided once per model class."""
    parameters = inspect.signature(model_class.forward).parameters
    return NEW_CACHE_KEYWORD if NEW_CACHE_KEYWORD in parameters else OLD_CACHE_KEYWORD
