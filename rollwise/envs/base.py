"""The environment contract of multi-turn episodes.

An episode alternates policy turns with environment turns:

    state = env.reset(prompt)
    loop: the policy writes an assistant message (one engine request continuing the episode's tokens)
          result = env.step(state, assistant_text) -> StepResult(messages, done, reward_parts, tool_calls)
          if result.done: stop; else append result.messages (tool results, feedback) and go on
    at most `env.max_turns` assistant turns.

The environment sees and returns TEXT only; the episode runner (`rollwise.envs.episode`) owns the token ids and
never re-tokenises what the policy generated. `env.stop` are the stop strings of its tool-call syntax (the
engine stops a turn there). The state is whatever `reset` returns; it must pickle (partial rollouts carry
unfinished episodes across steps and checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from rollwise.errors import UserError
from rollwise.types import Message, Prompt, ToolCall


@dataclass
class StepResult:
    """What the environment answers to one assistant message.

    `messages`: chat messages appended before the next assistant turn (`role` "tool" or "user"); empty when
    `done`. `reward_parts`: per-turn parts, summed over the episode into `Sample.reward_parts` (`env/<key>`)
    for shaping. `tool_calls`: the calls this message made, with their results. `parse_failures`: tool calls
    the policy attempted that could not be parsed.
    """

    messages: list[Message] = field(default_factory=list)
    done: bool = False
    reward_parts: dict[str, float] = field(default_factory=dict)
    tool_calls: list[ToolCall] = field(default_factory=list)
    parse_failures: int = 0


@runtime_checkable
class Env(Protocol):
    """A multi-turn environment (see the module docstring)."""

    name: str
    max_turns: int
    stop: tuple[str, ...]

    def reset(self, prompt: Prompt) -> Any:
        ...

    def step(self, state: Any, assistant_text: str) -> StepResult:
        ...


@dataclass
class Tool:
    """A function the policy may call: `fn(**args) -> str` (the text the policy reads back).

    `params` names the arguments in order; a tag-style call `<name>TEXT</name>` passes TEXT as the first one.
    A tool signals a failed call by raising; the episode records the error and shows the policy its message.
    A tool that can run long (code) enforces its own time limit (rollwise.sandbox).
    """

    name: str
    description: str
    fn: Callable[..., str]
    params: tuple[str, ...] = ("query",)

    def __call__(self, **args: Any) -> str:
        return str(self.fn(**args))


class EnvError(UserError, ValueError):
    """A user-facing configuration error of an environment (unknown env, bad options)."""
