"""Tool-call syntaxes, by name: how a call is written in an assistant message and where a turn stops.

- `tag` (default): `<NAME>ARGUMENT</NAME>` for a tool called NAME, e.g. `<calc>123*45</calc>`; the text
  between the tags is the tool's first parameter. SmolLM2-135M writes it reliably after one worked example.
- `hermes`: `<tool_call>{"name": NAME, "arguments": {...}}</tool_call>` (Hermes / Qwen style JSON).

`parse(text, tools) -> ParseOutcome`: the calls found and the attempts that could not be parsed (an opening tag
without its closing one, bad JSON, a missing name, a tool the env does not have: `tag` never matches one, and
`hermes` reports it as a failure with the tools there are, so it is never counted as a call). The engine stops
a turn at `stop(tools)`, so a turn holds at most one call; a message without any attempt is the policy's final
answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollwise.envs.base import EnvError, Tool
from rollwise.registry import Registry


@dataclass
class ParsedCall:
    name: str
    args: dict[str, Any]


@dataclass
class ParseOutcome:
    calls: list[ParsedCall] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # one line per unparseable attempt

    @property
    def attempted(self) -> bool:
        return bool(self.calls or self.failures)


class ToolParser(Protocol):
    name: str

    def stop(self, tools: dict[str, Tool]) -> tuple[str, ...]:
        ...

    def parse(self, text: str, tools: dict[str, Tool]) -> ParseOutcome:
        ...

    def render(self, name: str, args: dict[str, Any]) -> str:
        """The call as the policy should write it (worked examples, docs)."""
        ...


PARSERS: Registry = Registry("tool-call parser")


def unknown_tool(name: str, tools: dict[str, Tool]) -> str:
    """The error text of a call to a tool that is not in `tools` (a failed attempt, not a call)."""
    return f"unknown tool {name!r}; available: {', '.join(sorted(tools)) or 'none'}"


class TagParser:
    name = "tag"

    def stop(self, tools: dict[str, Tool]) -> tuple[str, ...]:
        return tuple(f"</{name}>" for name in tools)

    def parse(self, text: str, tools: dict[str, Tool]) -> ParseOutcome:
        out = ParseOutcome()
        for name, tool in tools.items():
            for match in re.finditer(rf"<{re.escape(name)}>(.*?)(</{re.escape(name)}>|$)", text, re.DOTALL):
                if not match.group(2):
                    out.failures.append(f"<{name}> is never closed with </{name}>")
                    continue
                out.calls.append(ParsedCall(name, {tool.params[0]: match.group(1).strip()}))
        return out

    def render(self, name: str, args: dict[str, Any]) -> str:
        (value,) = args.values() if len(args) == 1 else (json.dumps(args),)
        return f"<{name}>{value}</{name}>"


class HermesParser:
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def stop(self, tools: dict[str, Tool]) -> tuple[str, ...]:
        return (self.CLOSE,)

    def parse(self, text: str, tools: dict[str, Tool]) -> ParseOutcome:
        out = ParseOutcome()
        for chunk in text.split(self.OPEN)[1:]:
            body, closed, _ = chunk.partition(self.CLOSE)
            if not closed:
                out.failures.append(f"{self.OPEN} is never closed with {self.CLOSE}")
                continue
            try:
                call = json.loads(body)
            except json.JSONDecodeError as exc:
                out.failures.append(f"tool call is not JSON: {exc.msg} at column {exc.colno}")
                continue
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                out.failures.append('tool call needs {"name": ..., "arguments": {...}}')
                continue
            if call["name"] not in tools:
                out.failures.append(unknown_tool(call["name"], tools))
                continue
            args = call.get("arguments", {})
            if not isinstance(args, dict):
                out.failures.append(f"arguments of {call['name']!r} must be an object, got {type(args).__name__}")
                continue
            out.calls.append(ParsedCall(call["name"], args))
        return out

    def render(self, name: str, args: dict[str, Any]) -> str:
        return f"{self.OPEN}{json.dumps({'name': name, 'arguments': args})}{self.CLOSE}"


PARSERS.register("tag")(TagParser)
PARSERS.register("hermes")(HermesParser)


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS.get(name)()
    except KeyError as exc:
        raise EnvError(f"env.parser: {exc.args[0]}") from None
