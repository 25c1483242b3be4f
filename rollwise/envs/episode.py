"""Multi-turn episodes in the Generate stage, token-exact, with environment steps off the decode loop.

An episode is one `Sample` whose response holds every turn after the prompt (`rollwise.envs.turns`: the
engine's tokens kept exactly, the environment's messages rendered with the chat template at loss mask 0;
`episode/retokenize_mismatch` counts what a re-tokenising pipeline would have changed).

How turns reach the engine (`TurnSchedule`, `[env]` schedule / workers / lag_steps):

- `continuous` (engines with `caps.request_feed`; the default): `env.step` runs in a thread pool of
  `workers` threads while the engine keeps decoding, and the episode's next turn joins the running batch
  (continuous batching across turns, `rollwise.generate.feed`). Its result joins exactly `lag_steps` engine
  steps after the turn ended; a tool slower than that makes the engine wait for it there (`episode/stall_s`).
  Everything that decides the batch (when a turn joins, which groups complete first, what a StopRule aborts)
  is a function of the engine's steps, not of wall time, so a seed reproduces the run.
- `asap`: the same, but a turn joins as soon as its tool returns: the engine never waits for a tool, and the
  batch composition, hence the tokens sampled from the engine's one RNG stream and which groups a StopRule
  lets finish, depend on how long the tools took: not reproducible run to run.
- `rounds` (engines without a feed, or forced): every unfinished episode's turn goes to the engine in one
  `generate` call and each `env.step` runs in the engine's finish callback, in its thread: a slow tool holds
  up every sequence of the batch and turns advance in lockstep. The path before the feed existed.

Partial rollouts: an aborted turn keeps its tokens and continues in a later call; an episode stopped between
turns resumes at its next turn. `StopRule` works as in `rollwise.rollout.run_groups`. Status between turns is
PENDING; an episode left unfinished when a call returns is ABORTED.
"""

from __future__ import annotations

import concurrent.futures
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from itertools import count

from rollwise.envs.base import Env
from rollwise.envs.turns import (NO_ANSWER, EnvOutcome, EpisodeCodec, EpisodeState, append_env_tokens, apply_step,
                                 end_episode, end_turn, finish_turn, merge_turn, start_episode, step_env,
                                 turn_request)
from rollwise.generate.feed import WAIT_S
from rollwise.generate.groups import FINAL, GenerateStats, StopRule, is_complete
from rollwise.types import GenerationRequest, GenerationResult, Group, Message, Sample, SamplingParams, Status

__all__ = ["NO_ANSWER", "EpisodeCodec", "EpisodeState", "TurnSchedule", "append_env_tokens", "apply_step",
           "end_episode", "end_turn", "episode_metrics", "final_text", "finish_turn", "merge_turn", "run_episodes",
           "start_episode", "step_env", "transcript", "turn_request"]

SCHEDULES = ("continuous", "asap", "rounds")


@dataclass(frozen=True)
class TurnSchedule:
    """How turns reach the engine (see the module docstring): `kind` continuous | asap | rounds, `workers`
    threads stepping environments, `lag_steps` engine steps between a turn's end and its next turn joining
    (continuous)."""

    kind: str = "continuous"
    workers: int = 8
    lag_steps: int = 4

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES or self.workers < 1 or self.lag_steps < 0:
            raise ValueError(f"TurnSchedule: kind in {SCHEDULES}, workers >= 1, lag_steps >= 0; got {self}")

    @classmethod
    def from_config(cls, cfg) -> TurnSchedule:
        """From an `EnvConfig` (`env.schedule`, `env.workers`, `env.lag_steps`)."""
        return cls(cfg.schedule, cfg.workers, cfg.lag_steps)


def run_episodes(engine, groups: list[Group], params: SamplingParams, ids: count, env: Env, codec: EpisodeCodec,
                 stop: StopRule | None = None, max_episode_tokens: int = 512,
                 schedule: TurnSchedule = TurnSchedule()) -> GenerateStats:
    """Run every unfinished sample of `groups` as an episode (in place), turns scheduled by `schedule` (rounds
    on an engine without `caps.request_feed`).

    `params.max_new_tokens` bounds one assistant turn; `max_episode_tokens` everything after the prompt.
    With `stop`, once `stop.after_groups` groups are complete the rest are aborted (those in `stop.keep` run on).
    """
    samples = [s for g in groups for s in g.samples if s.status not in FINAL
               and not (s.episode is not None and s.episode.ended_by)]  # an ended (e.g. failed) episode stays
    for s in samples:
        if s.episode is None:
            start_episode(s, env, codec.system_prompt)
        s.status = Status.PENDING if s.status == Status.ABORTED else s.status  # continue it in this call
    turn_params = replace(params, stop=tuple(dict.fromkeys((*params.stop, *env.stop))))
    turns = _Turns(engine, groups, samples, turn_params, ids, env, codec, stop, max_episode_tokens)
    if schedule.kind != "rounds" and engine.caps.request_feed:
        turns.continuous(schedule)
    else:
        turns.rounds()
    for s in samples:
        if s.status == Status.PENDING:  # stopped between turns: continues at its next turn
            s.status = Status.ABORTED
    return GenerateStats(turns.requests, sum(s.status == Status.ABORTED for s in samples), len(turns.done))


class _Turns:
    """The bookkeeping of one `run_episodes` call. Every method runs on the thread that runs the engine's loop
    (its finish callbacks, the feed's `take`); worker threads run `step_env` only."""

    def __init__(self, engine, groups, samples, params, ids, env, codec, stop, max_episode_tokens) -> None:
        self.engine, self.samples, self.params, self.ids = engine, samples, params, ids
        self.env, self.codec, self.stop, self.max_episode_tokens = env, codec, stop, max_episode_tokens
        self.group_of = {id(s): g for g in groups for s in g.samples}
        self.done = {id(g) for g in groups if is_complete(g)}
        self.stopped = False
        self.running: dict[int, Sample] = {}  # request id -> its episode, while the engine holds the request
        self.requests = 0

    def wanted(self, sample: Sample) -> bool:
        """The episode has a next turn to run in this call."""
        return sample.status == Status.PENDING and (not self.stopped or sample.group_id in self.stop.keep)

    def request(self, sample: Sample) -> GenerationRequest:
        rid = next(self.ids)
        self.running[rid] = sample
        self.requests += 1
        return turn_request(sample, self.params, rid, self.max_episode_tokens)

    def observe(self, sample: Sample) -> None:
        """After any change to `sample`: count its group when complete; apply the StopRule."""
        group = self.group_of[id(sample)]
        if is_complete(group):
            self.done.add(id(group))
        if self.stop is not None and not self.stopped and len(self.done) >= self.stop.after_groups:
            self.stopped = True
            self.engine.abort([rid for rid, s in self.running.items() if s.group_id not in self.stop.keep])

    # -- rounds: one generate call per turn, env steps in the finish callback ----------------------------
    def rounds(self) -> None:
        while True:
            todo = [s for s in self.samples if self.wanted(s)]
            if not todo:
                return
            self.engine.generate([self.request(s) for s in todo], on_finish=self._finish_inline)

    def _finish_inline(self, result: GenerationResult) -> None:
        sample = self.running.pop(result.request_id)
        text = end_turn(sample, result, self.codec)
        if text is not None:
            outcome = step_env(self.env, sample.episode.env_state, text)
            sample.episode.stall_s += outcome.seconds  # the engine's loop waits for the step
            apply_step(sample, outcome, self.env, self.codec, self.max_episode_tokens)
        self.observe(sample)

    # -- continuous: one generate call, next turns fed in ------------------------------------------------
    def continuous(self, schedule: TurnSchedule) -> None:
        todo = [s for s in self.samples if self.wanted(s)]
        if not todo:
            return
        pool = ThreadPoolExecutor(schedule.workers, thread_name_prefix="rollwise-env")
        feed = _EpisodeFeed(self, pool, schedule, outstanding=len(todo))
        try:
            self.engine.generate([self.request(s) for s in todo], on_finish=feed.on_finish, feed=feed)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # a failed call leaves no env step running


@dataclass
class _Step:
    """An env step in the pool: whose, and the engine step at which its answer joins (continuous)."""

    sample: Sample
    future: concurrent.futures.Future
    due: int


class _EpisodeFeed:
    """The `Feed` of a continuous call (rollwise.generate.feed): finished turns go to the pool, answered ones
    come back as next-turn requests at their due step (`continuous`) or as soon as they are ready (`asap`)."""

    def __init__(self, turns: _Turns, pool: ThreadPoolExecutor, schedule: TurnSchedule, outstanding: int) -> None:
        self.turns, self.pool = turns, pool
        self.lag, self.asap = schedule.lag_steps, schedule.kind == "asap"
        self.pending: list[_Step] = []  # in dispatch order, hence in order of `due`
        self.outstanding = outstanding  # episodes with a turn in the engine or a step in the pool
        self.clock = 0  # engine steps of this call (the engine's `take` calls while it has work)

    @property
    def done(self) -> bool:
        return self.outstanding == 0

    def on_finish(self, result: GenerationResult) -> None:
        t = self.turns
        sample = t.running.pop(result.request_id)
        text = end_turn(sample, result, t.codec)
        if text is None:  # aborted (continues in a later call) or truncated (ended)
            self.outstanding -= 1
        else:
            future = self.pool.submit(step_env, t.env, sample.episode.env_state, text)
            self.pending.append(_Step(sample, future, self.clock + self.lag))
        t.observe(sample)

    def take(self, idle: bool) -> list[GenerationRequest]:
        """The next turns to admit now: answered env steps that are due (see the module docstring)."""
        if not idle:
            self.clock += 1
        elif self.pending and not self.asap:  # nothing to decode: the next due step is now
            self.clock = max(self.clock, self.pending[0].due)
        if self.asap:
            if idle and self.pending:  # nothing to decode: wait for the first answer (in slices, for Ctrl-C)
                concurrent.futures.wait([p.future for p in self.pending], WAIT_S, concurrent.futures.FIRST_COMPLETED)
            ready = [p for p in self.pending if p.future.done()]
        else:
            ready = [p for p in self.pending if p.due <= self.clock]
        if not ready:
            return []
        taken = {id(p) for p in ready}
        self.pending = [p for p in self.pending if id(p) not in taken]
        return [r for r in (self._answer(p, idle) for p in ready) if r is not None]

    def _answer(self, step: _Step, idle: bool) -> GenerationRequest | None:
        """Take one env step's answer (waiting for it if need be); the episode's next request, if any."""
        t, sample = self.turns, step.sample
        began = time.perf_counter()
        outcome: EnvOutcome = _result(step.future)
        if not idle:
            sample.episode.stall_s += time.perf_counter() - began
        apply_step(sample, outcome, t.env, t.codec, t.max_episode_tokens)
        t.observe(sample)
        if t.wanted(sample):
            return t.request(sample)
        self.outstanding -= 1
        return None


def _result(future: concurrent.futures.Future) -> EnvOutcome:
    """The future's result, waiting in short slices (a Ctrl-C in the engine's thread gets through)."""
    while True:
        try:
            return future.result(timeout=WAIT_S)
        except concurrent.futures.TimeoutError:
            continue


def transcript(sample: Sample) -> list[Message]:
    """Every message of the episode (prompt, assistant, tool results); one-turn samples: prompt + response."""
    if sample.episode is None:
        return [*sample.prompt.messages, {"role": "assistant", "content": sample.response_text}]
    return [dict(m) for m in sample.episode.messages]


def final_text(sample: Sample) -> str:
    return sample.episode.final_text if sample.episode is not None else sample.response_text


def episode_metrics(samples: list[Sample]) -> dict[str, float]:
    """`episode/*` means over finished episodes, failed ones included (none when no sample is an episode)."""
    ended = (*FINAL, Status.FAILED)
    eps = [s for s in samples if getattr(s, "episode", None) is not None and s.status in ended and s.episode.ended_by]
    if not eps:
        return {}
    n = len(eps)

    def mean(values) -> float:
        return float(sum(values)) / n

    out = {
        "episode/n": float(n),
        "episode/turns_mean": mean(s.episode.assistant_turns for s in eps),
        "episode/tool_calls_mean": mean(len(s.tool_calls) for s in eps),
        "episode/tool_errors": float(sum(c.error is not None for s in eps for c in s.tool_calls)),
        "episode/parse_failures": float(sum(s.episode.parse_failures for s in eps)),
        "episode/tool_s": float(sum(s.episode.tool_s for s in eps)),
        "episode/sandbox_s": float(sum(s.episode.sandbox_s for s in eps)),
        "episode/env_s": float(sum(s.episode.env_s for s in eps)),
        # absent from episodes pickled before it existed (carried over in a checkpoint)
        "episode/stall_s": float(sum(getattr(s.episode, "stall_s", 0.0) for s in eps)),
        "episode/tokens_mean": mean(len(s.response_ids) for s in eps),
        "episode/policy_tokens_mean": mean(sum(s.loss_mask) for s in eps),
        "episode/retokenize_mismatch": mean(bool(s.episode.retokenize_mismatch) for s in eps),
        "episode/env_errors": float(sum(s.episode.error is not None for s in eps)),
    }
    for reason in ("answer", "turn_limit", "token_limit", "truncated"):
        out[f"episode/ended_{reason}_frac"] = mean(s.episode.ended_by == reason for s in eps)
    return out
