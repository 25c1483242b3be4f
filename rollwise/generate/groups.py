"""Groups of samples in generation: what the Generate stage and the episode runner both build on.

A `Group` starts as `PENDING` samples with no tokens (`new_groups`). `unfinished_requests` asks for every sample
that is not final (`FINAL`), continuing from its tokens; `merge_result` takes an engine's `GenerationResult`
into its sample (tokens, behaviour log-probs, the `(start, end, policy_version)` span this call added). A
`StopRule` says when to abort the rest of a batch (partial rollouts); `GenerateStats` counts what one call did.
Engine calls live above: `rollwise.rollout.run_groups` (single-turn) and `rollwise.envs.episode.run_episodes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count

from rollwise.config import RolloutConfig
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
