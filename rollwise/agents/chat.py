"""Chat requests of an agent program -> prompt token ids, and engine results -> OpenAI chat replies.

An agent program sends its whole conversation with every call. Rendering it again with the chat template and
tokenising the text (what a plain OpenAI server does) gives ids that can differ from the ids the engine
sampled in earlier calls: BPE is not a bijection (decode + encode merges or splits tokens), templates drop
parts of earlier turns (Qwen3's past `<think>`), and a reply that came back as parsed `tool_calls` renders as
the template's JSON, not as the text the policy wrote. A trainer fed that text trains on tokens the policy never
sampled (TRL #5224, prime-rl #1334, verl's "Continuous Token" RFC #6719; the vLLM blog "No More Retokenization
Drift", 2025).

So a call whose messages start with an earlier call's messages and the reply rollwise gave it is *bridged*, as
AReaL's proxy (longest message-prefix parent), verifiers' renderer (`bridge_to_next_turn`) and TRL's
token-in/token-out loop do: its prompt is that call's prompt ids + completion ids + the template's closer of
the reply (minus what the policy already wrote, its EOS) + the new messages rendered as the text the template
adds after a fixed two-message prefix. Only a call whose history was rewritten (dropped, edited or summarised
messages, an edited reply) is rendered whole; `rollwise.agents.calls` then starts a new sample there.

`normalise(body)` validates a request into `ChatRequest` (`BadRequest` names the field); `ChatCodec` renders
(`prompt_ids`, `bridge`), counts drift (`canonical_ids`) and writes replies (`reply`, with Hermes
`<tool_call>{json}</tool_call>` blocks parsed into OpenAI `tool_calls` when the request offers tools).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from rollwise.data.prompts import chat_roles, fold_system, render_chat
from rollwise.types import GenerationResult, Status

_PROBE = [{"role": "user", "content": "rollwise-probe-user"}, {"role": "assistant", "content": "rollwise-probe-reply"}]
ROLES = ("system", "user", "assistant", "tool")
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class BadRequest(ValueError):
    """A request rollwise cannot run: HTTP `status` (400 unless said) with a one-line message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class ChatRequest:
    """A validated chat call: `messages` normalised (role, content text, `tool_calls` as [{name, arguments}],
    `tool_call_id`), `tools` as sent (OpenAI function tools), the call's `max_tokens` and `stop` (None: unset)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignored: list[str] = field(default_factory=list)  # sampling keys the run overrides (temperature, ...)

    @property
    def tools_key(self) -> str:
        return json.dumps(self.tools, sort_keys=True) if self.tools else ""


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, None (an assistant turn with tool calls only) or text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") not in ("text", "input_text") for p in content):
            raise BadRequest(f"{where}.content: only text parts are supported (got "
                             f"{sorted({str(p.get('type')) for p in content})})")
        return "".join(str(p.get("text", "")) for p in content)
    raise BadRequest(f"{where}.content must be a string, null or a list of text parts")


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as an object when they are JSON text (templates render objects), else as given."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def _tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise BadRequest(f"{where}.tool_calls must be a list")
    out = []
    for i, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where}.tool_calls[{i}] must be {{'type': 'function', 'function': {{'name', "
                             "'arguments'}}")
        out.append({"id": str(call.get("id") or ""), "name": fn["name"], "arguments": _arguments(fn.get("arguments"))})
    return out


def normalise_message(raw: Any, i: int) -> dict[str, Any]:
    """One request message -> {role, content[, tool_calls][, tool_call_id]}; 'developer' is a system turn."""
    where = f"messages[{i}]"
    if not isinstance(raw, dict) or not isinstance(raw.get("role"), str):
        raise BadRequest(f"{where} must be an object with a 'role'")
    role = "system" if raw["role"] == "developer" else raw["role"]
    if role not in ROLES:
        raise BadRequest(f"{where}.role = {raw['role']!r}; valid: {', '.join(ROLES)}, developer")
    out: dict[str, Any] = {"role": role, "content": _text(raw.get("content"), where)}
    if role == "assistant" and raw.get("tool_calls"):
        out["tool_calls"] = _tool_calls(raw["tool_calls"], where)
    if role == "tool" and raw.get("tool_call_id") is not None:
        out["tool_call_id"] = str(raw["tool_call_id"])
    return out


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "logit_bias")


def normalise(body: Any) -> ChatRequest:
    """Validate a chat-completions body (BadRequest naming the field); sampling keys are noted as ignored:
    episodes sample with the run's own settings, which the trainer's log-probs assume."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("stream"):
        raise BadRequest("stream = true is not supported by rollwise's agent endpoint; call without streaming")
    if body.get("n") not in (None, 1):
        raise BadRequest(f"n = {body.get('n')!r}: one completion per call (a group's episodes are separate programs)")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    tools = body.get("tools") or None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRequest("tools must be a list of {'type': 'function', 'function': {...}}")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or a list of them")
    return ChatRequest([normalise_message(m, i) for i, m in enumerate(messages)], tools, max_tokens, tuple(stop),
                       [k for k in SAMPLING_KEYS if body.get(k) is not None])


def same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal messages, tool-call ids aside (a program may mint its own)."""
    def key(m: dict[str, Any]) -> tuple:
        calls = tuple((c["name"], json.dumps(c["arguments"], sort_keys=True)) for c in m.get("tool_calls", ()))
        return m["role"], m["content"], calls, m.get("tool_call_id")

    return key(a) == key(b)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Hermes blocks `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in `text` -> (the text without the
    parsed blocks, [{name, arguments}]); a block that is not such JSON stays in the text."""
    calls: list[dict[str, Any]] = []

    def take(match: re.Match) -> str:
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            return match.group(0)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return match.group(0)
        calls.append({"name": call["name"], "arguments": _arguments(call.get("arguments", {}))})
        return ""

    rest = _TOOL_CALL.sub(take, text)
    return (rest.strip() if calls else text), calls


def completion_body(reply: dict[str, Any], result: GenerationResult, prompt_ids: list[int], model: str) -> dict:
    """OpenAI's chat.completion for a finished call, plus the ids: `prompt_token_ids` (what the engine
    continued), per choice `token_ids` and `token_logprobs` (what it sampled), and `policy_version`."""
    calls = reply.get("tool_calls", [])
    wire_calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": (
        c["arguments"] if isinstance(c["arguments"], str) else json.dumps(c["arguments"]))}} for c in calls]
    message = {"role": "assistant", "content": reply["content"] if reply["content"] or not calls else None,
               **({"tool_calls": wire_calls} if calls else {})}
    finish = "tool_calls" if calls else {Status.TRUNCATED: "length", Status.ABORTED: "abort"}.get(result.status, "stop")
    versions = sorted({v for _, _, v in result.version_spans})
    prompt_n, completion_n = len(prompt_ids), len(result.response_ids)
    return {"id": f"chatcmpl-rw-{uuid.uuid4().hex[:16]}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "policy_version": versions[-1] if versions else None, "prompt_token_ids": list(prompt_ids),
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None,
                         "token_ids": list(result.response_ids), "token_logprobs": list(result.logprobs)}],
            "usage": {"prompt_tokens": prompt_n, "completion_tokens": completion_n,
                      "total_tokens": prompt_n + completion_n}}


class ChatCodec:
    """Renders chat calls with the tokenizer's chat template (`rollwise.data.prompts.render_chat`'s adaptations:
    no system role, no tool role, no template) and builds bridged prompts. Not thread-safe: one thread uses it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._base: dict[str, str] = {}  # tools key -> render of the probe

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def render(self, messages: list[dict[str, Any]], tools: list | None, generation_prompt: bool) -> str:
        """The conversation as the chat template writes it (tools in its tool section when it has one)."""
        plain = [{"role": m["role"], "content": m["content"]} for m in messages]
        if not tools and not any(m.get("tool_calls") for m in messages):
            return render_chat(self.tokenizer, plain, generation_prompt)
        if not getattr(self.tokenizer, "chat_template", None):
            return render_chat(self.tokenizer, [_flatten(m) for m in messages], generation_prompt)
        system_ok, tool_ok = chat_roles(self.tokenizer)
        hf = [_hf_message(m) for m in messages]
        hf = hf if system_ok else fold_system(hf)
        hf = hf if tool_ok else [_flatten(m) if m["role"] == "tool" else m for m in hf]
        try:
            return self.tokenizer.apply_chat_template(hf, tools=tools, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as exc:  # the template refuses the conversation
            raise BadRequest(f"the chat template cannot render this conversation (roles "
                             f"{'/'.join(m['role'] for m in messages)}): {type(exc).__name__}: {exc}") from None

    def prompt_ids(self, request: ChatRequest) -> list[int]:
        """The whole conversation rendered and tokenised, ending with the assistant header."""
        return self.encode(self.render(request.messages, request.tools, True))

    def canonical_ids(self, messages: list[dict[str, Any]], tools: list | None) -> list[int]:
        """What a re-tokenising pipeline would feed the model for `messages` (drift is counted against it)."""
        return self.encode(self.render(messages, tools, True))

    def bridge(self, calls: list, session: str, request: ChatRequest) -> tuple[list[int], int, str] | None:
        """(prompt ids, index of the call bridged from, role of the first message after its reply) when
        `request` extends an earlier call of `calls` (`rollwise.agents.calls.Call`) of its session: that call's
        messages, then the reply rollwise gave it (as a message, or as its raw text); None when the history was
        rewritten (the call is then rendered whole)."""
        messages = request.messages
        for index in range(len(calls) - 1, -1, -1):
            call = calls[index]
            n = len(call.messages)
            if call.session != session or call.tools_key != request.tools_key or len(messages) <= n:
                continue
            if not all(same_message(a, b) for a, b in zip(call.messages, messages)):
                continue
            reply = messages[n]
            if reply["role"] != "assistant" or not (same_message(reply, call.reply) or (
                    not reply.get("tool_calls") and reply["content"] == call.text)):
                continue
            tail = messages[n + 1:]
            tail_ids = self.tail_ids(tail, request.tools, request.tools_key)
            if tail_ids is None:
                return None
            closing = self.closing_ids(call.completion_ids, request.tools, request.tools_key)
            return (call.prompt_ids + call.completion_ids + closing + tail_ids, index,
                    tail[0]["role"] if tail else "template")
        return None

    def _probe(self, tools: list | None, key: str) -> str:
        if key not in self._base:
            self._base = {} if len(self._base) > 64 else self._base
            self._base[key] = self.render(_PROBE, tools, False)
        return self._base[key]

    def closing_ids(self, completion_ids: list[int], tools: list | None, key: str) -> list[int]:
        """The template's end of an assistant message, minus the part the completion already holds (its EOS)."""
        base = self._probe(tools, key)
        reply = _PROBE[-1]["content"]
        closer = self.encode(base[base.rindex(reply) + len(reply):])
        for k in range(min(len(closer), len(completion_ids)), 0, -1):
            if completion_ids[-k:] == closer[:k]:
                return closer[k:]
        return closer

    def tail_ids(self, tail: list[dict[str, Any]], tools: list | None, key: str) -> list[int] | None:
        """`tail` and the next assistant header as the template renders them after earlier turns; None when the
        template renders earlier turns differently once these follow (then the call is rendered whole)."""
        base = self._probe(tools, key)
        full = self.render(_PROBE + tail, tools, True)
        return self.encode(full[len(base):]) if full.startswith(base) else None


def _hf_message(m: dict[str, Any]) -> dict[str, Any]:
    """A normalised message in the shape HF chat templates read (tool-call arguments as objects)."""
    out: dict[str, Any] = {"role": m["role"], "content": m["content"]}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", "id": c["id"] or f"call_{i}",
                              "function": {"name": c["name"], "arguments": c["arguments"]}}
                             for i, c in enumerate(m["tool_calls"])]
    if m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _flatten(m: dict[str, Any]) -> dict[str, str]:
    """A message as plain text for templates without tools (calls written as Hermes blocks, tool results as user
    turns)."""
    calls = "".join(f"<tool_call>{json.dumps({'name': c['name'], 'arguments': c['arguments']})}</tool_call>"
                    for c in m.get("tool_calls", ()))
    return {"role": "user" if m["role"] == "tool" else m["role"], "content": m["content"] + calls}
