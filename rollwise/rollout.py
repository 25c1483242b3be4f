"""The Generate stage: prompts -> groups of sampled responses (engine calls only)."""

from __future__ import annotations

from rollwise.config import RolloutConfig
from rollwise.generate.base import Engine
from rollwise.types import GenerationRequest, GenerationResult, Group, Prompt, Sample, SamplingParams


def sampling_params(cfg: RolloutConfig, temperature: float | None = None, max_new_tokens: int | None = None) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new_tokens or cfg.max_new_tokens,
        temperature=cfg.temperature if temperature is None else temperature,
        top_p=cfg.top_p if (temperature is None or temperature > 0) else 1.0,
        top_k=cfg.top_k if (temperature is None or temperature > 0) else 0,
        stop=tuple(cfg.stop),
    )


def generate_groups(
    engine: Engine,
    prompts: list[tuple[Prompt, list[int]]],
    samples_per_prompt: int,
    params: SamplingParams,
    first_group_id: int = 0,
) -> list[Group]:
    """Sample `samples_per_prompt` responses for each encoded prompt; one Group per prompt."""
    results = engine.generate(make_requests(prompts, samples_per_prompt, params))
    return make_groups(prompts, samples_per_prompt, results, first_group_id)


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
    groups = []
    for i, (prompt, ids) in enumerate(prompts):
        gid = first_group_id + i
        samples = [
            Sample(
                prompt=prompt,
                prompt_ids=ids,
                response_ids=res.response_ids,
                behaviour_logprobs=res.logprobs,
                loss_mask=[1] * len(res.response_ids),
                status=res.status,
                group_id=gid,
                version_spans=res.version_spans,
                response_text=res.text,
            )
            for res in results[i * samples_per_prompt : (i + 1) * samples_per_prompt]
        ]
        groups.append(Group(gid, prompt, samples))
    return groups
