"""Differences between the transformers releases rollwise supports (5.16 to 5.x).

vLLM 0.32 pins transformers < 5.20, where a model's forward takes its KV cache as `past_key_values`; later
releases call it `cache` (the old name is deprecated there, to be removed). `cache_kwargs` names it right for
the model at hand.
"""

from __future__ import annotations

import functools
import inspect


@functools.cache
def _cache_name(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(module, cache) -> dict:
    """`{"cache": cache}` or `{"past_key_values": cache}`, whichever `module.forward` takes."""
    return {_cache_name(type(module)): cache}
