"""The Generate stage: prompts -> groups of sampled responses (engine calls only).

A `Group` is created with `PENDING` samples (no tokens yet; `rollwise.generate.groups`). `run_groups` asks the
engine for every sample that is not finished, continuing aborted ones from their tokens, and merges each
result into its sample: tokens, behaviour log-probs and the `(start, end, policy_version)` span of the tokens
this call added.
With a `StopRule`, it aborts the rest of the batch once that many groups are complete (partial rollouts,
APRIL), except the groups the rule keeps running: the aborted samples keep their tokens and continue in a
later call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import count
from typing import Any, Protocol

import torch

from rollwise.generate.base import Engine
from rollwise.generate.groups import (
    FINAL,
    GenerateStats,
    StopRule,
    is_complete,
    merge_result,
    unfinished_requests,
)
from rollwise.types import GenerationResult, Group, Sample, SamplingParams, Status


def run_groups(engine: Engine, groups: list[Group], params: SamplingParams, ids: count,
               stop: StopRule | None = None) -> GenerateStats:
    """Generate every unfinished sample of `groups` (in place). With `stop`, abort what is left once
    `stop.after_groups` of `groups` are complete; aborted samples keep their tokens (status ABORTED)."""
    todo = unfinished_requests(groups, params, ids)
    stats = GenerateStats(requests=len(todo))
    if not todo:
        stats.groups_completed = sum(is_complete(g) for g in groups)
        return stats
    sample_of = {req.request_id: s for req, s in todo}
    group_of = {id(s): g for g in groups for s in g.samples}
    done = {id(g) for g in groups if is_complete(g)}
    stopped = False

    def on_finish(result: GenerationResult) -> None:
        nonlocal stopped
        sample = sample_of[result.request_id]
        merge_result(sample, result)
        group = group_of[id(sample)]
        if is_complete(group):
            done.add(id(group))
        if stop is not None and not stopped and len(done) >= stop.after_groups:
            stopped = True
            engine.abort([r for r, s in sample_of.items() if s.status not in FINAL and s.group_id not in stop.keep])

    engine.generate([req for req, _ in todo], on_finish=on_finish)
    stats.aborted = sum(s.status == Status.ABORTED for s in sample_of.values())
    stats.groups_completed = len(done)
    return stats


# -- where generation runs: this process, or a generation process (control.mode = "async") -------------------
@dataclass
class JobResult:
    """A finished generation job: the policy version that generated it, its wall time and engine counters."""

    version: int
    generate_s: float
    stats: GenerateStats


@dataclass
class Episodes:
    """How a run's samples become multi-turn episodes: its environment, codec, token budget and turn schedule
    (rollwise.envs.episode). `recipe` rebuilds it in a generation process (`control.mode = "async"`)."""

    env: object
    codec: object
    max_episode_tokens: int
    schedule: object = None  # a rollwise.envs.episode.TurnSchedule; None = its defaults
    recipe: EpisodeRecipe | None = None

    def run(self, engine: Engine, groups: list[Group], params: SamplingParams, ids: count,
            stop: StopRule | None = None) -> GenerateStats:
        from rollwise.envs.episode import TurnSchedule, run_episodes

        return run_episodes(engine, groups, params, ids, self.env, self.codec, stop, self.max_episode_tokens,
                            self.schedule or TurnSchedule())


@dataclass
class EpisodeRecipe:
    """What a generation process needs to build a run's `Episodes` itself: plain data (the `[env]` config, the
    task's default environment, the system prompt), never the built environment, which may hold what does not
    pickle. The environment is built again from its name: a built-in, or a plugin `'pkg.module:factory'` the
    child can import (an environment registered at run time in this process only cannot be)."""

    env: object  # an EnvConfig
    task_env: str | None
    system_prompt: str | None

    def build(self, tokenizer) -> Episodes:
        """The `Episodes` in this process (EnvError when its environment cannot be built here)."""
        from rollwise.envs import EnvError, build_env
        from rollwise.envs.episode import EpisodeCodec, TurnSchedule

        try:
            env = build_env(self.env, self.task_env)
        except EnvError as exc:  # the trainer's process built it: what differs here is what can be imported
            raise EnvError(f"{exc} (a generation process builds the environment again from [env]; a factory "
                           "registered at run time in the trainer's process only is unknown there: name it as "
                           "'package.module:function')") from None
        return Episodes(env, EpisodeCodec(tokenizer, self.system_prompt), self.env.max_episode_tokens,
                        TurnSchedule.from_config(self.env), self)


def episodes_for(cfg, env, tokenizer, task_env: str | None) -> Episodes:
    """The run's `Episodes` around its built `env` (`cfg`: the run config; `[env]` gives budget and schedule)."""
    from rollwise.envs.episode import EpisodeCodec, TurnSchedule

    recipe = EpisodeRecipe(cfg.env.model_copy(deep=True), task_env, cfg.data.system_prompt)
    return Episodes(env, EpisodeCodec(tokenizer, cfg.data.system_prompt), cfg.env.max_episode_tokens,
                    TurnSchedule.from_config(cfg.env), recipe)


class Rollouts(Protocol):
    """Where a run's generation happens: jobs are submitted and waited on, weights pushed in (unchecked: the Sync
    stage checks), counters kept. `engine` is the engine in this process (None when it lives elsewhere: a
    generation process, a `rollwise serve`); `threads` the torch threads of a generation process (None here);
    `pop_metrics()` what the rollouts measured since the last call (e.g. the TRB warm-up's budget)."""

    engine: Engine | None
    episodes: Episodes | None
    stats: Any
    threads: int | None

    def submit(self, job: int, groups: list[Group], params: SamplingParams, min_version: int = 0,
               stop: StopRule | None = None) -> None: ...

    def wait(self, job: int) -> JobResult: ...

    def push_weights(self, state, version: int) -> None: ...

    def pop_metrics(self) -> dict[str, float]: ...

    def close(self) -> None: ...


class LocalRollouts:
    """Generation in this process with the run's engine: a submitted job runs when it is waited on.
    With `episodes`, every sample is a multi-turn episode in that environment; otherwise `strategy` (a
    `rollwise.rollout_strategies` object, `rollout.strategy`) runs each round, or `run_groups` without one."""

    threads = None  # generation runs on this process's threads

    def __init__(self, engine: Engine, episodes: Episodes | None = None, strategy=None):
        self.engine = engine
        self.episodes = episodes
        self.strategy = strategy
        self.stats = engine.stats
        self._ids = count()
        self._jobs: dict[int, tuple] = {}

    def submit(self, job: int, groups: list[Group], params: SamplingParams, min_version: int = 0,
               stop: StopRule | None = None) -> None:
        self._jobs[job] = (groups, params, stop)

    def wait(self, job: int) -> JobResult:
        groups, params, stop = self._jobs.pop(job)
        start = time.perf_counter()
        if self.episodes is not None:
            stats = self.episodes.run(self.engine, groups, params, self._ids, stop)
        elif self.strategy is not None:
            stats = self.strategy.run(self.engine, groups, params, self._ids, stop)
        else:
            stats = run_groups(self.engine, groups, params, self._ids, stop)
        return JobResult(self.engine.version, time.perf_counter() - start, stats)

    def push_weights(self, state, version: int) -> None:
        """Copy `state` (parameters by name, or a module's) into the engine as `version`, unchecked (the run's
        Sync stage goes through `rollwise.sync.WeightSync`, which checks)."""
        if isinstance(state, torch.nn.Module):
            state = {name: p.detach() for name, p in state.named_parameters()}
        self.engine.update_weights(state, version)

    def pop_metrics(self) -> dict[str, float]:
        out = self.strategy.metrics() if self.strategy is not None else {}
        engine_metrics = getattr(self.engine, "pop_metrics", None)  # e.g. `rollout/spec_accept_rate`
        return {**out, **engine_metrics()} if engine_metrics is not None else out

    def close(self) -> None:
        self.engine.close()


class ProcessRollouts:
    """Generation in a `GenerationProcess`: jobs run there in submission order, each with the newest weights
    pushed so far (and at least `min_version`), while this process trains. With `episodes` (the process was
    started with their recipe), every job's samples run there as whole episodes: the groups go to the child
    and come back with their episodes."""

    engine = None  # the engine lives in the generation process

    def __init__(self, process, episodes: Episodes | None = None):
        from rollwise.generate.torch_engine import EngineStats

        self.process = process
        self.episodes = episodes  # this process's copy (evaluation); jobs run the child's
        self.stats = EngineStats()
        self.threads: int | None = None  # the generation process's torch threads, from its results
        self._ids = count()
        self._jobs: dict[int, tuple[list[Group], dict[int, Sample]]] = {}
        self._finished: dict[int, object] = {}

    def submit(self, job: int, groups: list[Group], params: SamplingParams, min_version: int = 0,
               stop: StopRule | None = None) -> None:
        if stop is not None:
            raise ValueError("a generation process runs whole jobs: partial rollouts need control.mode = 'sync'")
        if self.episodes is not None:
            self._jobs[job] = (groups, {})
            self.process.submit_episodes(job, groups, params, min_version=min_version)
            return
        todo = unfinished_requests(groups, params, self._ids)
        self._jobs[job] = (groups, {req.request_id: s for req, s in todo})
        self.process.submit(job, [req for req, _ in todo], min_version=min_version)

    def wait(self, job: int) -> JobResult:
        while job not in self._finished:
            done = self.process.receive()
            self._finished[done.ticket] = done
        done = self._finished.pop(job)
        groups, sample_of = self._jobs.pop(job)
        for result in done.results:
            merge_result(sample_of[result.request_id], result)
        if done.groups is not None:  # episodes: the child's samples replace ours, under our prompt objects
            for group, back in zip(groups, done.groups, strict=True):
                for s in back.samples:
                    s.prompt = group.prompt
                group.samples[:] = back.samples
        for key, value in done.stats.items():
            setattr(self.stats, key, getattr(self.stats, key) + value)
        self.threads = done.threads or self.threads
        completed = sum(is_complete(g) for g in groups)
        stats = done.job_stats or GenerateStats(len(sample_of), 0, completed)
        return JobResult(done.version, done.generate_s, stats)

    def push_weights(self, state: dict, version: int) -> None:
        """`state`: the policy's parameters by name (the trainer's `policy_state()`)."""
        self.process.push_weights(state, version)

    def pop_metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self.process.close()
