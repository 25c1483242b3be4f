"""How episode turns reach the engine (rollwise.envs.episode, `TurnSchedule`): environment steps in a pool,
next turns fed into the running batch, reproducible whatever the tools' wall times; rounds as before."""

from __future__ import annotations

import random
import threading
import time
from itertools import count

import pytest

from rollwise.envs.base import StepResult
from rollwise.envs.episode import EpisodeCodec, TurnSchedule, episode_metrics, run_episodes
from rollwise.generate.groups import StopRule, new_groups
from rollwise.generate.torch_engine import TorchEngine
from rollwise.types import SamplingParams, Status
from test_episodes import EchoEnv, encoded, policy

STOPS = tuple("etaoinshrdlu 0123456789")  # a turn of the tiny random model ends at almost any token


class SleepyEnv(EchoEnv):
    """EchoEnv whose every step sleeps: a fixed `sleep_s`, or a random time up to `jitter_s` (own RNG)."""

    def __init__(self, sleep_s: float = 0.0, jitter_s: float = 0.0, seed: int = 0, **kw):
        super().__init__(**kw)
        self.sleep_s, self.jitter_s, self.rng = sleep_s, jitter_s, random.Random(seed)
        self.lock, self.now, self.most = threading.Lock(), 0, 0  # steps running at once

    def step(self, state, text):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(self.sleep_s + self.rng.uniform(0.0, self.jitter_s))
            return super().step(state, text)
        finally:
            with self.lock:
                self.now -= 1


def run(env, schedule, samples_per_prompt=4, stop=None, max_new_tokens=16, seed=2, max_batch_size=64):
    model, tok = policy("tiny")
    engine = TorchEngine(model, tok, seed=seed, max_batch_size=max_batch_size)
    groups = new_groups(encoded(tok), samples_per_prompt, 0)
    start = time.perf_counter()
    stats = run_episodes(engine, groups, SamplingParams(max_new_tokens=max_new_tokens), count(), env,
                         EpisodeCodec(tok), stop=stop, max_episode_tokens=400, schedule=schedule)
    return groups, stats, time.perf_counter() - start


def fingerprint(groups):
    """Everything an episode is made of, per sample (wall times aside)."""
    return [(s.status, s.response_ids, s.behaviour_logprobs, s.loss_mask, s.version_spans, s.turns,
             s.episode.ended_by, s.episode.messages) for g in groups for s in g.samples]


@pytest.mark.parametrize("stop", [None, StopRule(after_groups=1)], ids=["whole", "stop_rule"])
def test_continuous_episodes_are_reproducible_whatever_the_tools_take(stop):
    """Tools that answer at once, then tools with random delays of up to 30 ms (tens of engine steps of the tiny
    model): the same seed gives the same episodes, aborts included, because a turn joins the batch at a fixed
    engine step, not when its tool happens to return."""
    schedule = TurnSchedule("continuous", lag_steps=2)
    fast, fast_stats, _ = run(SleepyEnv(turns=3, stop=("e",)), schedule, stop=stop)
    slow, slow_stats, _ = run(SleepyEnv(jitter_s=0.03, seed=7, turns=3, stop=("e",)), schedule, stop=stop)
    assert fingerprint(fast) == fingerprint(slow)
    assert fast_stats == slow_stats
    turns = [s.episode.assistant_turns for g in fast for s in g.samples]
    assert max(turns) == 3 and fast_stats.requests >= sum(turns)  # an aborted turn is a request, not a turn
    if stop is not None:
        assert fast_stats.aborted > 0 and any(s.status == Status.ABORTED for g in fast for s in g.samples)


def stall(groups) -> float:
    return episode_metrics([s for g in groups for s in g.samples])["episode/stall_s"]


def test_a_slow_tool_no_longer_holds_up_the_batch():
    """Tools of 0.1 s, 6 episodes of 2 tool steps. In rounds each step runs in the engine's finish callback, one
    after another: the decode loop stands still for all 12 (`episode/stall_s` >= 1.2 s). In a pool the steps
    overlap one another and the decoding: `asap` never waits for a tool, `continuous` only when a tool is
    slower than its lag (here about once per wave of turns, not once per step)."""
    env_kw = dict(sleep_s=0.1, turns=2, stop=STOPS)
    rounds = run(SleepyEnv(**env_kw), TurnSchedule("rounds"), samples_per_prompt=2)[0]
    pooled = run(SleepyEnv(**env_kw), TurnSchedule("continuous", workers=8, lag_steps=2), samples_per_prompt=2)[0]
    asap = run(SleepyEnv(**env_kw), TurnSchedule("asap", workers=8), samples_per_prompt=2)[0]
    for groups in (rounds, pooled, asap):  # the same work: every episode stepped its env twice
        assert [len(s.tool_calls) for g in groups for s in g.samples] == [2] * 6
    assert stall(rounds) >= 1.2
    assert stall(pooled) < 0.5 and stall(asap) < 0.05


@pytest.mark.slow
def test_slow_tools_side_by_side_wall_time():
    """The same 6 episodes with tools of 0.8 s: rounds take at least 9.6 s of tool time in a row; a pool of 8
    overlaps them (two waves of 0.8 s). The margin (5 s of the 8 s saved) leaves room for what a loaded
    machine does to the decoding of either side."""
    env_kw = dict(sleep_s=0.8, turns=2, stop=STOPS)
    _, _, rounds_s = run(SleepyEnv(**env_kw), TurnSchedule("rounds"), samples_per_prompt=2)
    _, _, pooled_s = run(SleepyEnv(**env_kw), TurnSchedule("continuous", lag_steps=2), samples_per_prompt=2)
    assert rounds_s >= 9.6
    assert pooled_s < rounds_s - 5.0


@pytest.mark.parametrize("workers", [1, 4])
def test_workers_bound_the_steps_that_run_at_once(workers):
    env = SleepyEnv(sleep_s=0.05, turns=2, stop=STOPS)
    run(env, TurnSchedule("continuous", workers=workers), samples_per_prompt=3)
    assert env.most == workers  # 9 episodes end their first turn together: the pool is the bound


class BrokenMessages(EchoEnv):
    """Answers with a message that has no content: rendering it fails in the runner, not in env.step."""

    def step(self, state, text):
        return StepResult(messages=[{"role": "tool"}])


def test_a_failure_outside_env_step_stops_the_call_and_leaves_no_worker():
    with pytest.raises(KeyError, match="content"):
        run(BrokenMessages(stop=STOPS), TurnSchedule("continuous"))
    assert not [t for t in threading.enumerate() if t.name.startswith("rollwise-env")]


def test_the_schedule_is_checked():
    with pytest.raises(ValueError, match="kind in"):
        TurnSchedule("eventually")
    with pytest.raises(ValueError, match="workers >= 1"):
        TurnSchedule(workers=0)
