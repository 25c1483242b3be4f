"""Held-out evaluation: sampled and greedy accuracy on a task's fixed evaluation split."""

from __future__ import annotations

from rollwise.generate.base import Engine
from rollwise.rewards import DEFAULT_TIMEOUT_S, score_samples
from rollwise.rollout import make_groups
from rollwise.types import GenerationRequest, Prompt, SamplingParams, Status

EVAL_SEED = 1234  # evaluation samples from its own stream, so it never shifts training's RNG


def evaluate(
    engine: Engine,
    prompts: list[tuple[Prompt, list[int]]],
    reward_fn,
    temperature: float,
    max_new_tokens: int,
    greedy: bool = True,
    reward_timeout_s: float | None = DEFAULT_TIMEOUT_S,
) -> dict[str, float]:
    """One response per prompt at `temperature` (and one greedy), each reward call limited to `reward_timeout_s`
    (`reward.timeout_s`). Returns `eval/*` metrics:
    `eval/sampled_accuracy`, `eval/greedy_accuracy`, `eval/response_len_mean`,
    `eval/greedy_response_len_mean`, `eval/n`, `eval/reward_errors`.
    """
    out: dict[str, float] = {"eval/n": float(len(prompts))}
    modes = [("sampled", temperature)] + ([("greedy", 0.0)] if greedy else [])
    params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=t, seed=EVAL_SEED) for _, t in modes]
    # one engine call, the modes of each prompt next to each other: they share that prompt's prefill
    requests = [GenerationRequest(i * len(modes) + k, ids, p)
                for i, (_, ids) in enumerate(prompts) for k, p in enumerate(params)]
    results = engine.generate(requests)
    for k, (label, _) in enumerate(modes):
        groups = make_groups(prompts, 1, results[k :: len(modes)])
        samples = [g.samples[0] for g in groups]
        metrics = score_samples(samples, reward_fn, reward_timeout_s)
        scored = [s for s in samples if s.status != Status.FAILED]  # failed rewards are errors, not wrong answers
        n = max(1, len(samples))
        prefix = "eval/" if label == "sampled" else "eval/greedy_"
        out[f"eval/{label}_accuracy"] = sum(bool(s.correct) for s in scored) / max(1, len(scored))
        out[f"{prefix}response_len_mean"] = sum(len(s.response_ids) for s in samples) / n
        out[f"{prefix}truncated_frac"] = sum(s.status.value == "truncated" for s in samples) / n
        out[f"{prefix}reward_errors"] = metrics.get("reward/errors", 0.0)
    return out
