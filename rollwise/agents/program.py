"""An agent program: what it is given, how its return value becomes the episode's reward, and the reward
function that reads it.

A program is a Python callable named `pkg.module:fn` (`agent.program`), called once per episode as
`fn(task, client)`: `task` is an `AgentTask` (the prompt's messages, answer and info, the endpoint and this
episode's key), `client` an `openai.OpenAI` (an `openai.AsyncOpenAI` for an `async def` program) already
pointed at rollwise's loopback endpoint. It may make any number of chat calls (up to `agent.max_calls`) and
run its tools in between. It returns (as AReaL's proxy workflows do) one of:

- a reward: a number, a bool or a `RewardResult` -> the episode's reward, as returned;
- the final answer (a string) -> scored by the run's reward function (`reward.fn`, else the task's);
- None -> the last reply's content is the final answer, scored the same way.

A program that raises, hangs past `agent.timeout_s`, or returns anything else fails its episode: the sample
is marked failed and counted (`reward/errors`, `agent/failed`), never scored 0, and a run in which every
episode failed for `reward.max_failed_steps` steps stops.
"""

from __future__ import annotations

import inspect
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

from rollwise.registry import load_dotted
from rollwise.types import Prompt, RewardResult, Sample

INFO_KEY = "agent"  # Sample.info[INFO_KEY]: the episode's outcome, which `AgentReward` reads


class AgentFailure(RuntimeError):
    """The agent program failed its episode (raised, timed out, returned something unusable)."""


@dataclass
class AgentTask:
    """What an agent program gets for one episode.

    `messages`: the prompt's chat (with `data.system_prompt` as a system turn when set); `answer` and `info`: the
    prompt's reference and extras; `base_url` / `api_key`: the loopback endpoint and this episode's key (for a
    program that builds its own client); `model`: the name to send (any name is served the policy);
    `max_tokens`: the most tokens one call may generate (`rollout.max_new_tokens`); `options`: `agent.options`.
    """

    prompt: Prompt
    messages: list[dict[str, str]]
    answer: str | None
    info: dict[str, Any]
    base_url: str
    api_key: str
    model: str
    max_tokens: int
    options: dict[str, Any] = field(default_factory=dict)
    sample_index: int = 0  # which sample of its group (0 .. samples_per_prompt - 1)


@dataclass
class Outcome:
    """How an episode ended, as the runner reads a program's return value.

    `reward`: the episode's reward (a number, bool or RewardResult), None when the final answer is scored;
    `answer`: the final answer text (None: the last reply's content); `session_rewards`: per-session rewards
    (a verifiers episode scores each of its traces); `untrained`: sessions whose calls are not trained (a
    frozen judge); `error`: why the episode failed (the sample is marked failed)."""

    reward: Any = None
    answer: str | None = None
    session_rewards: dict[str, Any] = field(default_factory=dict)
    untrained: set[str] = field(default_factory=set)
    error: str | None = None


def outcome_of(value: Any) -> Outcome:
    """A program's return value as an `Outcome` (see the module docstring); an unusable value is an error."""
    if isinstance(value, Outcome):
        return value
    if value is None:
        return Outcome()
    if isinstance(value, str):
        return Outcome(answer=value)
    if isinstance(value, (RewardResult, bool, numbers.Real)) or _is_scalar(value):
        return Outcome(reward=value)
    return Outcome(error=f"the agent program returned a {type(value).__name__}; return a reward (a number, a bool "
                         "or a RewardResult), the final answer (a string) or None")


def _is_scalar(value: Any) -> bool:
    """A numpy scalar or a 0-d tensor (what `rollwise.rewards.as_result` accepts)."""
    return hasattr(value, "item") and getattr(value, "shape", None) == ()


def load_program(name: str) -> Callable:
    """The callable `pkg.module:fn` (ValueError naming `agent.program` when it does not import or is no callable)."""
    try:
        fn = load_dotted(name)
    except ValueError as exc:
        raise ValueError(f"agent.program = {name!r}: {exc}") from None
    if not callable(fn):
        raise ValueError(f"agent.program = {name!r} is a {type(fn).__name__}, not a function fn(task, client)")
    return fn


def is_async(program: Any) -> bool:
    """Whether calling `program` returns a coroutine (an `async def`, or an object with an async `__call__`)."""
    return inspect.iscoroutinefunction(program) or inspect.iscoroutinefunction(getattr(program, "__call__", None))


class AgentReward:
    """The run's reward function when episodes come from agent programs: an episode that failed raises
    `AgentFailure` (the sample is marked failed and counted); one whose program returned a reward gets it; any
    other sample (a returned or last final answer, an evaluation without agents) is scored by `inner`."""

    def __init__(self, inner: Callable) -> None:
        self.inner = inner

    def __call__(self, sample: Sample) -> Any:
        outcome = sample.info.get(INFO_KEY)
        if outcome is None:
            return self.inner(sample)
        if outcome.get("error"):
            raise AgentFailure(outcome["error"])
        if outcome.get("reward") is not None:
            return outcome["reward"]
        return self.inner(sample)

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()
