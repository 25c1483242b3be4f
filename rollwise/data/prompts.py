"""Prompt -> token ids through the tokenizer's chat template, with a length limit that drops, never truncates.

`render_chat` is the one place a conversation becomes text, for prompts, episodes (`rollwise.envs.episode`)
and demonstrations. It adapts to the templates users meet:

- a template without a system role (Gemma 1/2 raise on one, some drop it): the system message is folded into
  the first user turn, `system + "\n\n" + user`, as Gemma 3's own template does;
- a template without a tool role (Gemma's roles must alternate user/model): tool messages are user turns;
- no template at all (a base model): the messages' contents one per line and a newline where the reply
  starts, after the BOS token where the tokenizer puts one before a text (Llama's), so a one-message prompt
  is its own text.

What a template supports is probed once per template (a render with marker messages) and logged once.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from rollwise.errors import UserError
from rollwise.types import Message, Prompt

logger = logging.getLogger(__name__)
PLAIN = "plain"  # `chat_format` of a tokenizer without a chat template
_SYSTEM_PROBE, _TOOL_PROBE = "rollwise-probe-system", "rollwise-probe-tool"


class ChatTemplateError(UserError, ValueError):
    """The tokenizer's chat template cannot render a conversation; the message names the roles and the fix."""


def with_system(messages: list[Message], system_prompt: str | None) -> list[Message]:
    """Prepend a system turn when `system_prompt` is set and the chat has none; None keeps the template's."""
    if system_prompt is None or any(m["role"] == "system" for m in messages):
        return list(messages)
    return [{"role": "system", "content": system_prompt}, *messages]


def render_prompt(prompt: Prompt, tokenizer: Any, system_prompt: str | None) -> str:
    """The chat rendered as text, ending with the assistant generation header."""
    return render_chat(tokenizer, with_system(prompt.messages, system_prompt), generation_prompt=True)


def render_chat(tokenizer: Any, messages: list[Message], generation_prompt: bool) -> str:
    """`messages` as the text the tokenizer's chat template makes of them (adapted as the module says)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        _note(PLAIN, "tokenizer has no chat template (a base model): prompts are the messages' text, one per line")
        text = "\n".join(m["content"] for m in messages) + ("\n" if generation_prompt else "")
        return _bos_text(tokenizer) + text
    system_ok, tool_ok = chat_roles(tokenizer)
    if not system_ok:
        messages = fold_system(messages)
    if not tool_ok:
        messages = [{**m, "role": "user"} if m["role"] == "tool" else m for m in messages]
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # jinja2's TemplateError from the template's raise_exception, or a render error
        roles = "/".join(m["role"] for m in messages)
        raise ChatTemplateError(
            f"the chat template of the tokenizer cannot render a conversation with roles {roles} "
            f"({type(exc).__name__}: {exc}); give the prompts roles it accepts, or a tokenizer_config.json "
            "chat_template that renders them") from exc


def _bos_text(tokenizer: Any) -> str:
    """The BOS token's text when the tokenizer puts one before a text by itself (Llama's), else ""."""
    bos = getattr(tokenizer, "bos_token", None)
    if not bos or tokenizer.bos_token_id is None:
        return ""
    return bos if tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id] else ""


def fold_system(messages: list[Message]) -> list[Message]:
    """A leading system message folded into the first user turn (`system + "\n\n" + user`)."""
    if not messages or messages[0]["role"] != "system":
        return list(messages)
    system, rest = messages[0]["content"], list(messages[1:])
    if rest and rest[0]["role"] == "user":
        return [{**rest[0], "content": f"{system}\n\n{rest[0]['content']}"}, *rest[1:]]
    return [{"role": "user", "content": system}, *rest]


def chat_roles(tokenizer: Any) -> tuple[bool, bool]:
    """(renders a system message, renders a tool message) for the tokenizer's chat template; probed once per
    template with marker messages (a template may refuse a role with raise_exception, or drop it)."""
    template = tokenizer.chat_template
    if template not in _ROLES:
        _ROLES[template] = (_shows(tokenizer, [{"role": "system", "content": _SYSTEM_PROBE},
                                               {"role": "user", "content": "u"}], _SYSTEM_PROBE),
                            _shows(tokenizer, [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
                                               {"role": "tool", "content": _TOOL_PROBE}], _TOOL_PROBE))
        if len(_ROLES) > 64:
            _ROLES.pop(next(iter(_ROLES)))
    system, tool = _ROLES[template]
    if not system:
        _note(template + ":system", "the chat template has no system role: a system prompt is folded into the "
                                    "first user turn")
    if not tool:
        _note(template + ":tool", "the chat template has no tool role: tool results are rendered as user turns")
    return system, tool


def _shows(tokenizer: Any, messages: list[Message], marker: str) -> bool:
    try:
        return marker in tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # the template refuses the role (raise_exception) or cannot render it
        return False


_ROLES: dict[str, tuple[bool, bool]] = {}
_NOTED: set[str] = set()


def _note(key: str, message: str) -> None:
    """Log `message` once per process and key (what a template lacks is said once, not per prompt)."""
    if key not in _NOTED:
        _NOTED.add(key)
        logger.warning(message)


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
