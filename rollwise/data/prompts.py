"""Prompt -> token ids through the tokenizer's chat template, with a length limit that drops, never truncates."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from rollwise.types import Message, Prompt


def with_system(messages: list[Message], system_prompt: str | None) -> list[Message]:
    """Prepend a system turn when `system_prompt` is set and the chat has none; None keeps the template's."""
    if system_prompt is None or any(m["role"] == "system" for m in messages):
        return list(messages)
    return [{"role": "system", "content": system_prompt}, *messages]


def render_prompt(prompt: Prompt, tokenizer: Any, system_prompt: str | None) -> str:
    """The chat rendered as text, ending with the assistant generation header."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no chat template; cannot encode prompt {prompt.source!r}"
        )
    messages = with_system(prompt.messages, system_prompt)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_prompt(prompt: Prompt, tokenizer: Any, system_prompt: str | None) -> list[int]:
    """Token ids of the chat-templated prompt (with the generation prompt).

    Renders to text first and tokenizes without adding special tokens: the template already holds them,
    and this works whether `apply_chat_template(tokenize=True)` returns a list or a BatchEncoding.
    """
    text = render_prompt(prompt, tokenizer, system_prompt)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [int(i) for i in ids]


class PromptEncoder:
    """Encodes prompts with a cache by uid; prompts over `max_prompt_tokens` are dropped and counted.

    `encode` returns None for a dropped prompt (and adds one to `dropped` each time), never a truncated one.
    """

    def __init__(
        self,
        tokenizer: Any,
        system_prompt: str | None = None,
        max_prompt_tokens: int = 256,
        cache_size: int = 100_000,
    ) -> None:
        if max_prompt_tokens <= 0:
            raise ValueError(f"max_prompt_tokens must be > 0, got {max_prompt_tokens}")
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.max_prompt_tokens = max_prompt_tokens
        self.cache_size = cache_size
        self.dropped = 0
        self._cache: OrderedDict[str, list[int]] = OrderedDict()

    def _ids(self, prompt: Prompt) -> list[int]:
        ids = self._cache.get(prompt.uid)
        if ids is None:
            ids = encode_prompt(prompt, self.tokenizer, self.system_prompt)
            self._cache[prompt.uid] = ids
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(prompt.uid)
        return ids

    def encode(self, prompt: Prompt) -> list[int] | None:
        """Token ids (a fresh list), or None when the prompt is longer than `max_prompt_tokens`."""
        ids = self._ids(prompt)
        if len(ids) > self.max_prompt_tokens:
            self.dropped += 1
            return None
        return list(ids)

    def metrics(self) -> dict[str, float]:
        """Counters to log under `data/`."""
        return {"data/prompts_dropped_too_long": float(self.dropped)}
