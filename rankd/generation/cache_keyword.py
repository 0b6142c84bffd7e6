"""The keyword a model's forward takes its KV cache by.

transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and is removed in
5.40), while every earlier 5.x release knows only `past_key_values`. shardbook allows any
transformers 5, so it asks the model's own forward which name it takes.
"""

import functools
import inspect
from typing import Any


def cache_keyword(model: Any) -> str:
    """`cache` where the model's forward (and so its `generate`) takes it, else `past_key_values`."""
    return _keyword_of(type(model))


@functools.cache
def _keyword_of(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
