"""Data contracts that cross stage boundaries.

Only these types travel between Generate, Score, Filter, Control, Replay and Train.
Token sequences are plain Python lists here; the trainer turns them into padded tensors.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Status(str, enum.Enum):
    """Lifecycle of one response."""

    PENDING = "pending"
    COMPLETED = "completed"  # stopped at EOS or a stop string
    TRUNCATED = "truncated"  # hit max_new_tokens
    ABORTED = "aborted"  # stopped by the controller; may be continued later
    FAILED = "failed"  # reward function raised, or the sample is unusable


Message = dict[str, str]


@dataclass
class Prompt:
    """One prompt from a task or a dataset.

    `messages` is a chat (list of {"role", "content"}); `answer` is the reference the verifier uses.
    `source` names where it came from (task name or `file:row`) for error messages. `origin` is the name of
    the `[[data.mix]]` source it was drawn from ("" with one source): per-source metrics group by it.
    """

    uid: str
    messages: list[Message]
    answer: str | None = None
    source: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    origin: str = ""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling options. `temperature == 0` means greedy."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    stop: tuple[str, ...] = ()
    seed: int | None = None  # a fixed seed for this request (evaluation); None uses the engine's stream


@dataclass
class GenerationRequest:
    """What an engine is asked to do: continue `prompt_ids` (+ any earlier `response_ids`)."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    response_ids: list[int] = field(default_factory=list)  # tokens already generated (resume)
    response_logprobs: list[float] = field(default_factory=list)
    # untruncated log-probs of `response_ids` (see `GenerationResult.full_logprobs`); empty = `response_logprobs`
    response_full_logprobs: list[float] = field(default_factory=list)


@dataclass
class GenerationResult:
    """Engine output for one request.

    `logprobs[i]` is the log-probability of `response_ids[i]` under the distribution the engine
    actually sampled from (after temperature, top-k and top-p): the behaviour logprob.
    `full_logprobs[i]` is its log-probability under the same temperature without top-k / top-p (what the
    trainer computes); equal to `logprobs[i]` when nothing is truncated. Empty from an engine that does not
    report it.
    `version_spans` lists `(start, end, policy_version)` over response positions.
    """

    request_id: int
    response_ids: list[int]
    logprobs: list[float]
    status: Status
    version_spans: list[tuple[int, int, int]]
    text: str = ""
    full_logprobs: list[float] = field(default_factory=list)


@dataclass
class ToolCall:
    """One tool call of an episode: what the policy asked for and what came back.

    `result` is the text fed back to the policy; `error` is set when the call failed (an unknown tool, bad
    arguments, the tool raised or timed out); then `result` holds the error text the policy sees.
    """

    name: str
    args: dict[str, Any]
    turn: int  # the assistant turn (0-based) that made the call
    result: str = ""
    error: str | None = None
    wall_s: float = field(default=0.0, repr=False, compare=False)  # seconds (left out of repr and ==)
    sandbox_s: float = field(default=0.0, repr=False, compare=False)  # time inside the sandbox, for code tools


@dataclass
class RewardResult:
    """Outcome of one reward function on one sample. `error` is set when it failed.

    `correct`: whether the answer is right (accuracy, Self-Routing, demonstrations read it); None lets scoring
    decide from a `correct` part, else `value > 0`. `info`: extras merged into `Sample.info` when the result
    is applied (a reward never writes to the sample itself: under `reward.isolate` that would be lost)."""

    value: float
    parts: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    correct: bool | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Sample:
    """One response to one prompt, with everything the trainer needs.

    Lengths: `response_ids`, `behaviour_logprobs`, `full_logprobs` and `loss_mask` all have the response length.
    `behaviour_logprobs` are under the distribution sampled from (after top-k / top-p: the importance-sampling
    proposal); `full_logprobs` under the same temperature without truncation (compared with the trainer's in
    `mismatch/*`); empty when the engine did not report them (then read as `behaviour_logprobs`).
    `version_spans`: `(start, end, policy_version)` over response positions (partial rollouts mix).
    """

    prompt: Prompt
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    loss_mask: list[int]
    status: Status
    group_id: int
    version_spans: list[tuple[int, int, int]] = field(default_factory=list)
    full_logprobs: list[float] = field(default_factory=list)
    # multi-turn episodes (rollwise.envs): `(start, end, role)` over response positions, role "assistant" for
    # the policy's own tokens (loss mask 1) and "tool" / "user" / "template" for appended ones (mask 0)
    turns: list[tuple[int, int, str]] = field(default_factory=list)
    tool_calls: list["ToolCall"] = field(default_factory=list)
    episode: Any = None  # rollwise.envs.episode.EpisodeState of an unfinished or finished episode; None = one turn
    response_text: str = ""
    reward: float | None = None
    reward_parts: dict[str, float] = field(default_factory=dict)
    reward_error: str | None = None
    reward_traceback: str | None = None  # full traceback text of the reward failure (reward_error is one line)
    correct: bool | None = None
    advantage: float = 0.0
    train_reward: float | None = None  # reward after shaping and KL penalty (Filter stage); None = `reward`
    replayed: bool = False  # drawn from the replay buffer into a later batch
    # distillation (rollwise.distill): the teacher's log-prob of each response token, `[T]` (empty: not scored),
    # its top-k `([T][k] log-probs, [T][k] ids)` for GKD, and the weights of the sample's reward advantage,
    # teacher term and SFT term in the loss (Self-Routing and SFT stages set them)
    teacher_logprobs: list[float] = field(default_factory=list)
    teacher_topk: Any = None
    route: str = ""  # Self-Routing: grpo, self_distill, regularise or skip ("" = not routed)
    loss_weights: tuple[float, float, float] = (1.0, 1.0, 0.0)  # (reward advantage, teacher term, sft NLL)
    info: dict[str, Any] = field(default_factory=dict)  # free-form extras of plugins; no stage reads it

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class Group:
    """The samples of one prompt (a GRPO group)."""

    group_id: int
    prompt: Prompt
    samples: list[Sample]

    def usable(self) -> list[Sample]:
        return [s for s in self.samples if s.status != Status.FAILED]


@dataclass
class FilterResult:
    """Keep/drop decision with the reason counted under `filter/<reason>`."""

    keep: bool
    reason: str = ""
