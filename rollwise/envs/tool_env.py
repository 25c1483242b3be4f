"""`ToolEnv`: the common multi-turn environment. The policy calls tools until it answers without a call.

Each assistant message is parsed with the env's parser (rollwise.envs.parsers). A message with calls gets one
tool message back holding every call's result (or error text); a message without any call attempt ends the
episode (it is the final answer the reward scores). Unparseable attempts, and calls to a tool the env does not
have (whatever parser made them), are fed back as errors and counted as parse failures, never as calls.
Per-step reward parts: `tool_calls` (calls to the env's tools, failed ones included), `tool_errors` (those that
failed), `parse_failures` (summed per episode as `env/<part>`; shaping reads them: rollwise.algo.tool_shaping).
"""

from __future__ import annotations

import ast
import operator
import time
from typing import Any

from rollwise.envs.base import StepResult, Tool
from rollwise.envs.parsers import ParsedCall, ToolParser, get_parser, unknown_tool
from rollwise.types import Prompt, ToolCall

MAX_RESULT_CHARS = 2000  # a longer tool result is cut (and says so): it would crowd out the episode's budget


class ToolEnv:
    """Tools + a parser. Subclasses may override `tools_for(prompt)` for per-prompt tools (records, files).

    The episode state is a plain dict `{"prompt": Prompt, "turn": int}` (it pickles)."""

    def __init__(self, tools: list[Tool], parser: str | ToolParser = "tag", max_turns: int = 4,
                 name: str = "tool", result_role: str = "tool") -> None:
        self.name = name
        self.max_turns = max_turns
        self.parser = get_parser(parser) if isinstance(parser, str) else parser
        self.tools = {t.name: t for t in tools}
        self.result_role = result_role
        self.stop = self.parser.stop(self.tools)

    def tools_for(self, prompt: Prompt) -> dict[str, Tool]:
        return self.tools

    def reset(self, prompt: Prompt) -> dict[str, Any]:
        return {"prompt": prompt, "turn": 0}

    def step(self, state: dict[str, Any], assistant_text: str) -> StepResult:
        tools = self.tools_for(state["prompt"])
        outcome = self.parser.parse(assistant_text, tools)
        turn = state["turn"]
        state["turn"] = turn + 1
        if not outcome.attempted:
            return StepResult(done=True, reward_parts={"tool_calls": 0.0, "tool_errors": 0.0, "parse_failures": 0.0})
        calls = [run_tool(tools, parsed, turn) for parsed in outcome.calls if parsed.name in tools]
        failures = outcome.failures + [unknown_tool(parsed.name, tools) for parsed in outcome.calls
                                       if parsed.name not in tools]
        lines = [c.result for c in calls] + [f"error: {f}" for f in failures]
        errors = sum(c.error is not None for c in calls)
        return StepResult(
            messages=[{"role": self.result_role, "content": "\n".join(lines)}],
            done=False,
            reward_parts={"tool_calls": float(len(calls)), "tool_errors": float(errors),
                          "parse_failures": float(len(failures))},
            tool_calls=calls,
            parse_failures=len(failures),
        )


def run_tool(tools: dict[str, Tool], parsed: ParsedCall, turn: int) -> ToolCall:
    """Call one tool; any failure becomes the call's `error` and the text the policy reads back."""
    call = ToolCall(name=parsed.name, args=dict(parsed.args), turn=turn)
    tool = tools.get(parsed.name)
    start = time.perf_counter()
    if tool is None:
        call.error = unknown_tool(parsed.name, tools)
    else:
        try:
            call.result = tool(**parsed.args)
        except Exception as exc:  # the policy's call failed: it sees the error and may try again
            call.error = f"{type(exc).__name__}: {exc}"
    call.wall_s = time.perf_counter() - start
    if call.error is not None:
        call.result = f"error: {call.error}"
    if len(call.result) > MAX_RESULT_CHARS:
        call.result = call.result[:MAX_RESULT_CHARS] + f"... [cut at {MAX_RESULT_CHARS} characters]"
    return call


# -- the calculator -----------------------------------------------------------------------------------------
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30
MAX_EXPRESSION_CHARS = 200


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses) without `eval`.

    ValueError with the reason for anything else (names, calls, exponents over 64, results over 1e30)."""
    text = expression.strip().replace("×", "*").replace("x", "*").replace("^", "**").replace(",", "")
    if not text:
        raise ValueError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression is over {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, RecursionError, MemoryError):
        raise ValueError(f"cannot parse {expression.strip()!r} as arithmetic") from None
    value = _evaluate(tree.body)
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError("result is too large")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        if abs(node.value) > MAX_MAGNITUDE:
            raise ValueError("number is too large")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is over {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        if abs(value) > MAX_MAGNITUDE:
            raise ValueError("result is too large")
        return value
    raise ValueError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


def calculator_tool() -> Tool:
    return Tool(name="calc", description="evaluates an arithmetic expression, e.g. <calc>123*45</calc>",
                fn=calculate, params=("expression",))
