"""The records of an agent episode (`Episode`, its `Call`s) and its calls -> training samples, token-exact.

Each model call is recorded as the engine ran it (`Call`: prompt ids, completion ids, behaviour and untruncated
log-probs, the policy version of every token). `stitch` chains the calls of one session (one conversation of
the program; a verifiers trace) in time order: a call whose prompt starts with everything before it -- the
previous call's prompt and completion -- token for token continues the same sample, and the tokens between
the two completions (the template's closer, tool results, the next assistant header) join it with loss mask
0. A call that does not extend (the program rewrote its history) starts another sample: it is counted
(`agent/retokenize_mismatch`), never trained as re-tokenised text. The samples of one episode share its
reward; `agent.on_mismatch = "drop"` leaves a split episode out instead.

    segments = stitch(calls)                   # [[Call, ...], ...] in time order
    fill_sample(sample, segments[0])           # prompt_ids, response_ids, logprobs, loss_mask, spans, turns
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from rollwise.agents.chat import ChatRequest
from rollwise.agents.program import AgentTask, Outcome
from rollwise.types import Group, Sample, SamplingParams, Status


@dataclass
class Call:
    """One chat call as the engine ran it. Lengths: `logprobs`, `full_logprobs` = len(completion_ids);
    `version_spans` over completion positions. `parent`: the index (in the episode's calls) of the call this one
    was bridged from, None when it was rendered whole; `tail_role` the role of the first message after that
    call's reply ("template" when none)."""

    session: str
    messages: list[dict[str, Any]]
    tools_key: str
    reply: dict[str, Any]
    text: str  # the completion's text as decoded (before tool calls were parsed out)
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    full_logprobs: list[float]
    version_spans: list[tuple[int, int, int]]
    status: Status
    parent: int | None = None
    tail_role: str = "template"
    canonical_drift: bool | None = None  # bridged ids differ from rendering the conversation whole
    wait_s: float = field(default=0.0, compare=False)  # queued before its engine call


@dataclass
class Episode:
    """One agent episode while it runs (`rollwise.agents.runner`): its sample, sampling params, task, deadline,
    the calls recorded so far and how it ended."""

    key: str
    group: Group
    sample: Sample
    params: SamplingParams
    task: AgentTask
    deadline: float = 0.0
    started: float = 0.0
    calls: list[Call] = field(default_factory=list)
    asked: int = 0  # calls taken for the engine (recorded or in flight)
    done: bool = False
    ended_by: str = ""  # returned | error | timeout | call_limit
    error: str | None = None
    outcome: Outcome | None = None
    handle: Any = None  # the program's thread, or its future on the event loop
    seconds: float = 0.0


@dataclass
class Pending:
    """A chat call waiting for the engine."""

    episode: Episode
    session: str
    body: Any
    future: Future
    arrived: float


@dataclass
class Prepared:
    """A call rendered for the engine: its prompt ids, and the call it was bridged from (None: rendered whole)."""

    pending: Pending
    request: ChatRequest
    prompt_ids: list[int]
    parent: int | None
    tail_role: str


def extends(call: Call, before: list[int]) -> bool:
    """`call`'s prompt starts with `before` (a segment's prompt + response so far), token for token."""
    return len(call.prompt_ids) >= len(before) and call.prompt_ids[:len(before)] == before


def stitch(calls: list[Call]) -> list[list[Call]]:
    """The calls grouped into segments, each one sample: per session in order of first call, a call joins the
    session's latest segment when its prompt extends that segment's tokens, else starts a new one."""
    segments: list[list[Call]] = []
    latest: dict[str, tuple[list[Call], list[int]]] = {}  # session -> (segment, its tokens so far)
    for call in calls:
        open_segment = latest.get(call.session)
        if open_segment is not None and extends(call, open_segment[1]):
            segment = open_segment[0]
            segment.append(call)
        else:
            segment = [call]
            segments.append(segment)
        latest[call.session] = (segment, call.prompt_ids + call.completion_ids)
    return segments


def fill_sample(sample: Sample, segment: list[Call]) -> None:
    """Write a segment into `sample`: the first call's prompt is the prompt; every completion has loss mask 1
    with its behaviour and untruncated log-probs and version spans; the tokens between completions have mask 0
    and log-prob 0.0. Status: TRUNCATED when the last call hit its token limit, else COMPLETED."""
    first = segment[0]
    sample.prompt_ids = list(first.prompt_ids)
    ids: list[int] = []
    logprobs: list[float] = []
    full: list[float] = []
    mask: list[int] = []
    spans: list[tuple[int, int, int]] = []
    turns: list[tuple[int, int, str]] = []
    for k, call in enumerate(segment):
        if k:
            between = call.prompt_ids[len(first.prompt_ids) + len(ids):]
            turns.append((len(ids), len(ids) + len(between), call.tail_role))
            ids += between
            logprobs += [0.0] * len(between)
            full += [0.0] * len(between)
            mask += [0] * len(between)
        start = len(ids)
        ids += call.completion_ids
        logprobs += call.logprobs
        full += call.full_logprobs if len(call.full_logprobs) == len(call.completion_ids) else call.logprobs
        mask += [1] * len(call.completion_ids)
        spans += [(start + a, start + b, v) for a, b, v in call.version_spans]
        turns.append((start, len(ids), "assistant"))
    sample.response_ids, sample.behaviour_logprobs, sample.full_logprobs = ids, logprobs, full
    sample.loss_mask, sample.version_spans, sample.turns = mask, spans, turns
    sample.status = Status.TRUNCATED if segment[-1].status == Status.TRUNCATED else Status.COMPLETED


def clear_sample(sample: Sample) -> None:
    """An episode with nothing to train (no call, or failed before any): no response tokens, COMPLETED so its
    group is scored, where the episode's error marks it failed."""
    sample.response_ids, sample.behaviour_logprobs, sample.full_logprobs = [], [], []
    sample.loss_mask, sample.version_spans, sample.turns = [], [], []
    sample.status = Status.COMPLETED


def copy_for_segment(sample: Sample) -> Sample:
    """A fresh sample of the same prompt and group for another segment of the episode."""
    return Sample(prompt=sample.prompt, prompt_ids=[], response_ids=[], behaviour_logprobs=[], loss_mask=[],
                  status=Status.PENDING, group_id=sample.group_id, info=dict(sample.info))
