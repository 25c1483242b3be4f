"""One episode's token ids, turn by turn (the mechanics under `rollwise.envs.episode`).

    prompt_ids | assistant turn 1 | closer + env message + assistant header | assistant turn 2 | ...
    loss_mask:      1 ... 1        |        0 ... 0                          |      1 ... 1

- `turn_request`: an assistant turn is one engine request continuing from the episode's ids so far (or an
  aborted turn's tokens); `merge_turn` keeps the engine's tokens, log-probs and version spans exactly.
- `end_turn` closes a turn and says what the environment must answer; `step_env` runs `env.step` (on any
  thread: it touches only the episode's own env state); `apply_step` appends the environment's messages as
  template tokens (mask 0, log-prob placeholder 0.0) or ends the episode. `finish_turn` is the three in a row.
- `EpisodeCodec` renders what the chat template puts between turns, and the canonical render that
  `episode/retokenize_mismatch` compares against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from rollwise.data.prompts import render_chat, with_system
from rollwise.envs.base import Env, EnvError, StepResult
from rollwise.types import GenerationRequest, GenerationResult, Message, Sample, SamplingParams, Status

_PROBE = [{"role": "user", "content": "rollwise-probe-user"}, {"role": "assistant", "content": "rollwise-probe-reply"}]


@dataclass
class EpisodeState:
    """What an episode carries between turns (pickles with the sample)."""

    env_state: Any
    messages: list[Message]  # the transcript: the prompt's messages (system turn included), then every
    # assistant and env message; the first `prompt_messages` are the prompt's
    prompt_messages: int = 0
    turn_start: int = 0  # response position where the current assistant turn begins
    assistant_turns: int = 0
    parts: dict[str, float] = field(default_factory=dict)  # the env's reward parts, summed over turns
    turn_parts: list[dict[str, float]] = field(default_factory=list)  # the same, per assistant turn
    parse_failures: int = 0
    # wall times (seconds) are left out of repr and ==: two identical episodes differ only in them
    tool_s: float = field(default=0.0, repr=False, compare=False)
    sandbox_s: float = field(default=0.0, repr=False, compare=False)
    env_s: float = field(default=0.0, repr=False, compare=False)  # time in env.step (tools included)
    # time the decode loop stood still waiting for this episode's environment (rounds: every env step)
    stall_s: float = field(default=0.0, repr=False, compare=False)
    ended_by: str = ""  # "answer" | "turn_limit" | "token_limit" | "truncated"
    final_text: str = ""
    retokenize_mismatch: bool | None = None
    error: str | None = None  # the environment raised: the sample is marked failed when scored


class EpisodeCodec:
    """Token ids of what the chat template puts between turns, and the canonical render for the mismatch count.

    `tokenizer`: a HF tokenizer (its chat template, adapted as `rollwise.data.prompts.render_chat` says: a
    system turn folded into the first user turn, tool results as user turns where the template has no such
    role, plain lines without a template); `system_prompt`: as the prompt encoder used it."""

    def __init__(self, tokenizer: Any, system_prompt: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self._base = self._render(_PROBE, generation_prompt=False)
        reply = _PROBE[-1]["content"]
        self.closer_ids = self.encode(self._base[self._base.rindex(reply) + len(reply):])
        self._blocks: dict[tuple, list[int]] = {}

    def _render(self, messages: list[Message], generation_prompt: bool) -> str:
        return render_chat(self.tokenizer, messages, generation_prompt)

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def closing_ids(self, turn_ids: list[int]) -> list[int]:
        """The template's end of an assistant message, minus the part the turn already generated (its EOS)."""
        closer = self.closer_ids
        for k in range(min(len(closer), len(turn_ids)), 0, -1):
            if turn_ids[-k:] == closer[:k]:
                return closer[k:]
        return list(closer)

    def message_ids(self, messages: list[Message]) -> list[int]:
        """`messages` and the next assistant header, as the template renders them after earlier turns."""
        key = tuple((m["role"], m["content"]) for m in messages)
        if key not in self._blocks:
            full = self._render(_PROBE + list(messages), generation_prompt=True)
            if not full.startswith(self._base):
                raise EnvError("the chat template renders earlier turns differently once a message follows them; "
                               "episodes need a template whose render of a conversation extends its prefix")
            self._blocks = {} if len(self._blocks) > 4096 else self._blocks
            self._blocks[key] = self.encode(full[len(self._base):])
        return list(self._blocks[key])

    def canonical_ids(self, messages: list[Message]) -> list[int]:
        """The transcript rendered and tokenised as a whole (what re-tokenising pipelines train on)."""
        return self.encode(self._render(with_system(messages, self.system_prompt), generation_prompt=False))


def start_episode(sample: Sample, env: Env, system_prompt: str | None = None) -> None:
    messages = [dict(m) for m in with_system(sample.prompt.messages, system_prompt)]
    sample.episode = EpisodeState(env_state=env.reset(sample.prompt), messages=messages, prompt_messages=len(messages))
    sample.response_ids, sample.behaviour_logprobs, sample.full_logprobs, sample.loss_mask = [], [], [], []
    sample.version_spans, sample.turns, sample.tool_calls = [], [], []


def turn_request(sample: Sample, params: SamplingParams, request_id: int, max_episode_tokens: int) -> GenerationRequest:
    """The engine request of the sample's current assistant turn (continuing an aborted one)."""
    start = sample.episode.turn_start
    budget = min(params.max_new_tokens, max_episode_tokens - start)
    return GenerationRequest(
        request_id, sample.prompt_ids + sample.response_ids[:start], replace(params, max_new_tokens=budget),
        response_ids=sample.response_ids[start:], response_logprobs=sample.behaviour_logprobs[start:],
        response_full_logprobs=sample.full_logprobs[start:])


def merge_turn(sample: Sample, result: GenerationResult) -> list[int]:
    """Take the engine's tokens of the current turn into the sample; returns the turn's ids."""
    start = sample.episode.turn_start
    earlier = sample.response_ids[start:]
    full = list(result.full_logprobs if len(result.full_logprobs) == len(result.response_ids) else result.logprobs)
    known = sample.full_logprobs[start:]
    if earlier and len(known) == len(earlier) and result.response_ids[:len(earlier)] == earlier:
        full[:len(earlier)] = known
    n = len(result.response_ids)
    sample.response_ids = sample.response_ids[:start] + list(result.response_ids)
    sample.behaviour_logprobs = sample.behaviour_logprobs[:start] + list(result.logprobs)
    sample.full_logprobs = sample.full_logprobs[:start] + full
    sample.loss_mask = sample.loss_mask[:start] + [1] * n
    sample.version_spans = sample.version_spans + [(start + a, start + b, v) for a, b, v in result.version_spans]
    return list(result.response_ids)


def append_env_tokens(sample: Sample, ids: list[int], role: str) -> None:
    """Tokens the policy did not sample: loss mask 0, log-prob placeholder 0.0, a turn of `role`."""
    if not ids:
        return
    start = len(sample.response_ids)
    sample.response_ids = sample.response_ids + list(ids)
    sample.behaviour_logprobs = sample.behaviour_logprobs + [0.0] * len(ids)
    sample.full_logprobs = sample.full_logprobs + [0.0] * len(ids)
    sample.loss_mask = sample.loss_mask + [0] * len(ids)
    sample.turns.append((start, start + len(ids), role))


NO_ANSWER = ("turn_limit", "token_limit")  # the policy was still calling tools when the episode was cut


def end_episode(sample: Sample, codec: EpisodeCodec, ended_by: str, status: Status) -> None:
    """Finish the episode. `response_text` (what outcome rewards score) is the final assistant message; an
    episode cut at the turn or token limit while the policy was still calling tools has NO answer (empty text),
    so a policy cannot score by ending on a tool call that happens to contain the answer."""
    ep = sample.episode
    ep.ended_by = ended_by
    sample.status = status
    sample.response_text = "" if ended_by in NO_ANSWER else ep.final_text
    canonical = codec.canonical_ids(ep.messages)
    ours = sample.prompt_ids + sample.response_ids
    if len(ours) > len(canonical) and ours[-1] == codec.tokenizer.eos_token_id:
        ours = ours[:-1]  # the final EOS, where the render closes no message with one (no template: plain text)
    ep.retokenize_mismatch = canonical[:len(ours)] != ours


def end_turn(sample: Sample, result: GenerationResult, codec: EpisodeCodec) -> str | None:
    """Merge a finished (or aborted) turn. Returns the assistant text the environment must answer, or None:
    the turn was aborted (status ABORTED, it continues later) or truncated (the episode ends)."""
    ep = sample.episode
    start = ep.turn_start
    turn_ids = merge_turn(sample, result)
    if result.status == Status.ABORTED:
        sample.status = Status.ABORTED
        return None
    sample.turns.append((start, start + len(turn_ids), "assistant"))
    ep.assistant_turns += 1
    text = codec.decode(turn_ids)
    ep.final_text = text
    ep.messages.append({"role": "assistant", "content": text})
    if result.status == Status.TRUNCATED:
        end_episode(sample, codec, "truncated", Status.TRUNCATED)
        return None
    sample.status = Status.PENDING  # until the environment has answered
    return text


@dataclass
class EnvOutcome:
    """What one `env.step` call gave: its result, or the error it raised, and its wall time."""

    step: StepResult | None
    error: str | None
    seconds: float


def step_env(env: Env, state: Any, text: str) -> EnvOutcome:
    """`env.step(state, text)`, timed; an exception becomes the outcome's error (the sample fails when scored)."""
    began = time.perf_counter()
    try:
        step = env.step(state, text)
    except Exception as exc:  # counted: the sample fails when scored, and persistent failures stop the run
        return EnvOutcome(None, f"{type(exc).__name__}: {exc}", time.perf_counter() - began)
    return EnvOutcome(step, None, time.perf_counter() - began)


def apply_step(sample: Sample, outcome: EnvOutcome, env: Env, codec: EpisodeCodec, max_episode_tokens: int) -> None:
    """Take the environment's answer to the turn `end_turn` closed: its messages as template tokens and the
    next turn's header (status PENDING), or the end of the episode."""
    ep = sample.episode
    ep.env_s += outcome.seconds
    if outcome.error is not None:
        ep.error = f"env {getattr(env, 'name', type(env).__name__)!r} step {ep.assistant_turns} failed: {outcome.error}"
        return end_episode(sample, codec, "env_error", Status.COMPLETED)
    step = outcome.step
    ep.turn_parts.append({k: float(v) for k, v in step.reward_parts.items()})
    for key, value in step.reward_parts.items():
        ep.parts[key] = ep.parts.get(key, 0.0) + float(value)
    ep.parse_failures += step.parse_failures
    sample.tool_calls = sample.tool_calls + list(step.tool_calls)
    ep.tool_s += sum(c.wall_s for c in step.tool_calls)
    ep.sandbox_s += sum(c.sandbox_s for c in step.tool_calls)
    if step.done or not step.messages:
        return end_episode(sample, codec, "answer", Status.COMPLETED)
    if ep.assistant_turns >= env.max_turns:
        return end_episode(sample, codec, "turn_limit", Status.COMPLETED)
    append_env_tokens(sample, codec.closing_ids(sample.response_ids[ep.turn_start:]), "template")
    append_env_tokens(sample, codec.message_ids(step.messages), step.messages[0]["role"])
    ep.messages.extend(dict(m) for m in step.messages)
    ep.turn_start = len(sample.response_ids)
    if ep.turn_start >= max_episode_tokens:
        return end_episode(sample, codec, "token_limit", Status.TRUNCATED)
    sample.status = Status.PENDING


def finish_turn(sample: Sample, result: GenerationResult, env: Env, codec: EpisodeCodec,
                max_episode_tokens: int) -> None:
    """Merge a finished (or aborted) turn, step the environment in this thread, take its answer."""
    text = end_turn(sample, result, codec)
    if text is not None:
        apply_step(sample, step_env(env, sample.episode.env_state, text), env, codec, max_episode_tokens)
