"""The Generate stage: prompts -> groups of sampled responses (engine calls only).

A `Group` is created with `PENDING` samples (no tokens yet). `run_groups` asks the engine for every sample
that is not finished, continuing aborted ones from their tokens, and merges each result into its sample:
tokens, behaviour log-probs and the `(start, end, policy_version)` span of the tokens this call added.
With a `StopRule`, it aborts the rest of the batch once that many groups are complete (partial rollouts,
APRIL), except the groups the rule keeps running: the aborted samples keep their tokens and continue in a
later call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import count

import torch

from rollwise.config import RolloutConfig
from rollwise.generate.base import Engine
from rollwise.types import GenerationRequest, GenerationResult, Group, Prompt, Sample, SamplingParams, Status

FINAL = (Status.COMPLETED, Status.TRUNCATED)


def sampling_params(cfg: RolloutConfig, temperature: float | None = None, max_new_tokens: int | None = None) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new_tokens or cfg.max_new_tokens,
        temperature=cfg.temperature if temperature is None else temperature,
        top_p=cfg.top_p if (temperature is None or temperature > 0) else 1.0,
        top_k=cfg.top_k if (temperature is None or temperature > 0) else 0,
        stop=tuple(cfg.stop),
    )


def new_groups(prompts: list[tuple[Prompt, list[int]]], samples_per_prompt: int, first_group_id: int) -> list[Group]:
    """One Group of `samples_per_prompt` PENDING samples per encoded prompt, ids counting from `first_group_id`."""
    groups = []
    for i, (prompt, ids) in enumerate(prompts):
        gid = first_group_id + i
        samples = [Sample(prompt=prompt, prompt_ids=ids, response_ids=[], behaviour_logprobs=[], loss_mask=[],
                          status=Status.PENDING, group_id=gid) for _ in range(samples_per_prompt)]
        groups.append(Group(gid, prompt, samples))
    return groups


def is_complete(group: Group) -> bool:
    return all(s.status in FINAL for s in group.samples)


def merge_result(sample: Sample, result: GenerationResult, text: str | None = None) -> None:
    """Take an engine result into its sample: the engine returns all tokens (earlier + new) and the spans of
    this call only, which are appended to the sample's earlier spans.

    Untruncated log-probs: the result's, or its behaviour log-probs when the engine reports none; on a
    continued sample the sample's own values of its earlier tokens are kept (a request may not carry them).
    """
    full = list(result.full_logprobs if len(result.full_logprobs) == len(result.response_ids) else result.logprobs)
    earlier = len(sample.response_ids)
    known = getattr(sample, "full_logprobs", [])  # absent from samples pickled before the field existed
    if earlier and len(known) == earlier and result.response_ids[:earlier] == sample.response_ids:
        full[:earlier] = known
    sample.full_logprobs = full
    sample.response_ids = list(result.response_ids)
    sample.behaviour_logprobs = list(result.logprobs)
    sample.loss_mask = [1] * len(result.response_ids)
    sample.status = result.status
    sample.version_spans = sample.version_spans + list(result.version_spans)
    sample.response_text = result.text if text is None else text


def oldest_version(samples: list[Sample], default: int) -> int:
    """Policy version of the oldest token among `samples` (`default` when none has a token)."""
    return min((v for s in samples for _, _, v in s.version_spans), default=default)


@dataclass(frozen=True)
class StopRule:
    """Abort what is left once `after_groups` groups are complete, except the groups in `keep` (group ids),
    which run to completion."""

    after_groups: int
    keep: frozenset[int] = frozenset()


@dataclass
class GenerateStats:
    """What one `run_groups` call did."""

    requests: int = 0
    aborted: int = 0
    groups_completed: int = 0


def unfinished_requests(groups: list[Group], params: SamplingParams,
                        ids: count) -> list[tuple[GenerationRequest, Sample]]:
    """A request for every sample of `groups` that is not final, continuing from its tokens."""
    out = []
    for group in groups:
        for s in group.samples:
            if s.status not in FINAL:
                req = GenerationRequest(next(ids), s.prompt_ids, params, response_ids=list(s.response_ids),
                                        response_logprobs=list(s.behaviour_logprobs),
                                        response_full_logprobs=list(s.full_logprobs))
                out.append((req, s))
    return out


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


def generate_groups(engine: Engine, prompts: list[tuple[Prompt, list[int]]], samples_per_prompt: int,
                    params: SamplingParams, first_group_id: int = 0) -> list[Group]:
    """Sample `samples_per_prompt` responses for each encoded prompt to completion; one Group per prompt."""
    groups = new_groups(prompts, samples_per_prompt, first_group_id)
    run_groups(engine, groups, params, count())
    return groups


def make_requests(prompts: list[tuple[Prompt, list[int]]], samples_per_prompt: int, params: SamplingParams,
                  first_request_id: int = 0) -> list[GenerationRequest]:
    """`samples_per_prompt` requests per prompt, ids counting up from `first_request_id`."""
    return [
        GenerationRequest(request_id=first_request_id + i * samples_per_prompt + j, prompt_ids=ids, params=params)
        for i, (_, ids) in enumerate(prompts)
        for j in range(samples_per_prompt)
    ]


def make_groups(prompts: list[tuple[Prompt, list[int]]], samples_per_prompt: int, results: list[GenerationResult],
                first_group_id: int = 0) -> list[Group]:
    """Results in request order (as `make_requests` made them) -> one Group per prompt."""
    groups = new_groups(prompts, samples_per_prompt, first_group_id)
    flat = [s for g in groups for s in g.samples]
    for sample, result in zip(flat, results):
        merge_result(sample, result)
    return groups


# -- where generation runs: this process, or a generation process (control.mode = "async") -------------------
@dataclass
class JobResult:
    """A finished generation job: the policy version that generated it, its wall time and engine counters."""

    version: int
    generate_s: float
    stats: GenerateStats


@dataclass
class Episodes:
    """How a run's samples become multi-turn episodes: its environment, codec and token budget
    (rollwise.envs.episode)."""

    env: object
    codec: object
    max_episode_tokens: int

    def run(self, engine: Engine, groups: list[Group], params: SamplingParams, ids: count,
            stop: StopRule | None = None) -> GenerateStats:
        from rollwise.envs.episode import run_episodes

        return run_episodes(engine, groups, params, ids, self.env, self.codec, stop, self.max_episode_tokens)


class LocalRollouts:
    """Generation in this process with the run's engine: a submitted job runs when it is waited on.
    With `episodes`, every sample is a multi-turn episode in that environment."""

    def __init__(self, engine: Engine, episodes: Episodes | None = None):
        self.engine = engine
        self.episodes = episodes
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
        else:
            stats = run_groups(self.engine, groups, params, self._ids, stop)
        return JobResult(self.engine.version, time.perf_counter() - start, stats)

    def push_weights(self, state, version: int) -> None:
        """Copy `state` (parameters by name, or a module's) into the engine as `version`, unchecked (the run's
        Sync stage goes through `rollwise.sync.WeightSync`, which checks)."""
        if isinstance(state, torch.nn.Module):
            state = {name: p.detach() for name, p in state.named_parameters()}
        self.engine.update_weights(state, version)

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


class ProcessRollouts:
    """Generation in a `GenerationProcess`: jobs run there in submission order, each with the newest weights
    pushed so far (and at least `min_version`), while this process trains."""

    def __init__(self, process):
        from rollwise.generate.torch_engine import EngineStats

        self.process = process
        self.stats = EngineStats()
        self.threads: int | None = None  # the generation process's torch threads, from its results
        self._ids = count()
        self._jobs: dict[int, tuple[list[Group], dict[int, Sample]]] = {}
        self._finished: dict[int, object] = {}

    def submit(self, job: int, groups: list[Group], params: SamplingParams, min_version: int = 0,
               stop: StopRule | None = None) -> None:
        if stop is not None:
            raise ValueError("a generation process runs whole jobs: partial rollouts need control.mode = 'sync'")
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
        for key, value in done.stats.items():
            setattr(self.stats, key, getattr(self.stats, key) + value)
        self.threads = done.threads or self.threads
        completed = sum(is_complete(g) for g in groups)
        return JobResult(done.version, done.generate_s, GenerateStats(len(sample_of), 0, completed))

    def push_weights(self, state: dict, version: int) -> None:
        """`state`: the policy's parameters by name (`rollwise.sync.policy_state`)."""
        self.process.push_weights(state, version)

    def close(self) -> None:
        self.process.close()
