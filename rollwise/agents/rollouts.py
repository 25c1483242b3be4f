"""Agent episodes as the run's Generate stage (`AgentRollouts`, the `Rollouts` protocol of
`rollwise.rollout`), and the `agent/*` metrics of a step.

Generation runs in this process with the run's engine, one job when it is waited on, like `LocalRollouts`;
every sample is an agent episode (`rollwise.agents.runner.AgentRunner`), split into one sample per segment
when a program rewrote its history (`rollwise.agents.calls`).
"""

from __future__ import annotations

import time
from collections import Counter
from itertools import count

import torch

from rollwise.agents.program import INFO_KEY
from rollwise.rollout import JobResult
from rollwise.types import Group, SamplingParams


class AgentRollouts:
    """Jobs of agent episodes on the run's `engine` (see the module docstring); `episodes` is the runner, which
    evaluation uses too."""

    threads = None  # generation runs on this process's threads

    def __init__(self, engine, runner) -> None:
        self.engine = engine
        self.episodes = runner
        self.stats = engine.stats
        self._ids = count()
        self._jobs: dict[int, tuple[list[Group], SamplingParams]] = {}
        self._totals: Counter = Counter()

    def submit(self, job: int, groups: list[Group], params: SamplingParams, min_version: int = 0,
               stop=None) -> None:
        if stop is not None:
            raise ValueError("agent episodes run whole: control.partial_rollouts is not supported with agents")
        self._jobs[job] = (groups, params)

    def wait(self, job: int) -> JobResult:
        groups, params = self._jobs.pop(job)
        start = time.perf_counter()
        stats = self.episodes.run(self.engine, groups, params, self._ids, totals=self._totals, split=True)
        return JobResult(self.engine.version, time.perf_counter() - start, stats)

    def push_weights(self, state, version: int) -> None:
        """Copy `state` into the engine as `version`, unchecked (the Sync stage checks)."""
        if isinstance(state, torch.nn.Module):
            state = {name: p.detach() for name, p in state.named_parameters()}
        self.engine.update_weights(state, version)

    def pop_metrics(self) -> dict[str, float]:
        """`agent/*` over the jobs since the last call (evaluation's episodes are not counted)."""
        if not self._totals["episodes"]:
            return {}
        out = agent_metrics(self._totals, self.episodes.hung())
        self._totals = Counter()
        return out

    def close(self) -> None:
        self.episodes.close()
        self.engine.close()


def job_counts(episodes: list) -> Counter:
    """Counters of one job's episodes (`rollwise.agents.runner.Episode`), summed over a step's jobs and turned
    into `agent/*` by `agent_metrics`."""
    calls = [c for e in episodes for c in e.calls]
    bridged = [c for c in calls if c.canonical_drift is not None]
    infos = [e.sample.info.get(INFO_KEY, {}) for e in episodes]
    return Counter({
        "episodes": len(episodes),
        "failed": sum(i.get("error") is not None for i in infos),
        "timeouts": sum(e.ended_by == "timeout" for e in episodes),
        "call_limit": sum(e.ended_by == "call_limit" for e in episodes),
        "calls": len(calls),
        "tool_calls": sum(len(c.reply.get("tool_calls", ())) for c in calls),
        "split_calls": sum(i.get("split_calls", 0) for i in infos),
        "split_episodes": sum(i.get("split_calls", 0) > 0 for i in infos),
        "bridged": len(bridged),
        "drift": sum(bool(c.canonical_drift) for c in bridged),
        "wait_s": sum(c.wait_s for c in calls),
        "seconds": sum(e.seconds for e in episodes),
    })


def agent_metrics(totals: Counter, hung: int = 0) -> dict[str, float]:
    """`agent/*` of a step: episodes, failures, calls, the token-exactness counts and times."""
    n, calls = max(1, totals["episodes"]), max(1, totals["calls"])
    return {
        "agent/episodes": float(totals["episodes"]),
        "agent/failed": float(totals["failed"]),
        "agent/timeouts": float(totals["timeouts"]),
        "agent/call_limit": float(totals["call_limit"]),
        "agent/calls_mean": totals["calls"] / n,
        "agent/tool_calls_mean": totals["tool_calls"] / n,
        # calls whose prompt does not extend the previous call's tokens: a new sample, never re-tokenised text
        "agent/retokenize_mismatch": float(totals["split_calls"]),
        "agent/split_frac": totals["split_episodes"] / n,
        # bridged calls whose ids differ from re-rendering the conversation (what a re-tokenising server sends)
        "agent/canonical_drift_frac": totals["drift"] / max(1, totals["bridged"]),
        "agent/call_wait_s_mean": totals["wait_s"] / calls,
        "agent/episode_s_mean": totals["seconds"] / n,
        "agent/hung_programs": float(hung),
    }
